// Tests for grace::read_guard, grace::pin(), grace::in_read_section() and the domain's
// read-section forms (domain::pin(), std::scoped_lock<grace::domain>).
//
// A read section is proven real by its effect on grace periods: a synchronize() that starts
// while a reader is inside must not return until that reader has left. Each such check has
// the reader linger inside for kHold (only to widen the window in which a broken guard would
// let synchronize() return early) and set a flag right before it leaves; synchronize() must
// observe the flag.
#include "grace/reclaim/read_guard.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "grace/reclaim/domain.h"
#include "tests/testing/testing.h"

namespace {

namespace gt = grace::testing;
using namespace std::chrono_literals;

// How long a reader lingers in its section to widen race windows (never for correctness).
constexpr auto kHold = 30ms;
constexpr auto kNoDeadlock = 30s;

using section_body = std::function<void()>;
// Enters a read section in some way, calls body() inside it, then leaves.
using section_fn = gt::lingering_reader::section;

// Runs `section` on a fresh thread (so its first guard also registers the thread) and calls
// d.synchronize() on this thread once the reader is inside; synchronize() must not return
// before the reader has left.
void expect_synchronize_waits_for(grace::domain& d, const section_fn& section) {
  gt::lingering_reader reader(kHold, 1, section);
  reader.wait_until_inside();
  {
    gt::watchdog dog(kNoDeadlock, "synchronize() with one reader inside");
    reader.go();
    d.synchronize();
  }
  const bool reader_had_left = reader.left_section();
  reader.join();
  EXPECT_TRUE(reader_had_left)
      << "synchronize() returned while a reader that entered its section before the call "
         "was still inside";
}

// ---------------------------------------------------------------------------------------------
// Single-threaded semantics.

TEST(ReadGuard, IsNeitherCopyableNorMovableAndEndsWithoutThrowing) {
  static_assert(!std::is_copy_constructible_v<grace::read_guard>);
  static_assert(!std::is_copy_assignable_v<grace::read_guard>);
  static_assert(!std::is_move_constructible_v<grace::read_guard>);
  static_assert(!std::is_move_assignable_v<grace::read_guard>);
  static_assert(std::is_nothrow_destructible_v<grace::read_guard>);
  static_assert(std::is_nothrow_default_constructible_v<grace::read_guard>);
  static_assert(noexcept(grace::pin()));
  static_assert(noexcept(grace::in_read_section()));
}

TEST(ReadGuard, InReadSectionIsTrueOnlyWhileAGuardIsHeld) {
  EXPECT_FALSE(grace::in_read_section());
  {
    auto g = grace::pin();
    EXPECT_TRUE(grace::in_read_section());
  }
  EXPECT_FALSE(grace::in_read_section());
  {
    grace::read_guard g;
    EXPECT_TRUE(grace::in_read_section());
  }
  EXPECT_FALSE(grace::in_read_section());
}

TEST(ReadGuard, NestedGuardsKeepTheSectionUntilTheOutermostEnds) {
  grace::domain& d = grace::domain::global();
  {
    auto outer = grace::pin();
    {
      auto middle = d.pin();
      {
        std::scoped_lock inner(d);
        EXPECT_TRUE(grace::in_read_section());
      }
      EXPECT_TRUE(grace::in_read_section());
    }
    EXPECT_TRUE(grace::in_read_section());
  }
  EXPECT_FALSE(grace::in_read_section());
}

TEST(ReadGuard, ReadSectionBelongsToTheThreadThatEnteredIt) {
  auto g = grace::pin();
  ASSERT_TRUE(grace::in_read_section());
  bool other_thread_in_section = true;
  std::thread([&] { other_thread_in_section = grace::in_read_section(); }).join();
  EXPECT_FALSE(other_thread_in_section);
  EXPECT_TRUE(grace::in_read_section());
}

TEST(ReadGuard, DomainPinAndScopedLockEnterAReadSection) {
  grace::domain d;
  {
    auto g = d.pin();
    EXPECT_TRUE(grace::in_read_section());
  }
  EXPECT_FALSE(grace::in_read_section());
  {
    std::scoped_lock<grace::domain> lock(d);
    EXPECT_TRUE(grace::in_read_section());
  }
  EXPECT_FALSE(grace::in_read_section());
  d.lock();
  EXPECT_TRUE(grace::in_read_section());
  d.unlock();
  EXPECT_FALSE(grace::in_read_section());
}

// ---------------------------------------------------------------------------------------------
// Grace periods wait for read sections.

TEST(ReadGuard, SynchronizeWaitsForAGuardTakenBeforeIt) {
  grace::domain d;
  for (int round = 0; round < 3; ++round) {
    expect_synchronize_waits_for(d, [](const section_body& body) {
      auto g = grace::pin();
      body();
    });
  }
}

TEST(ReadGuard, OuterGuardHoldsGracePeriodsAfterTheInnerGuardEnds) {
  grace::domain d;
  expect_synchronize_waits_for(d, [](const section_body& body) {
    auto outer = grace::pin();
    { auto inner = grace::pin(); }
    EXPECT_TRUE(grace::in_read_section());
    body();
  });
}

// grace inlines liburcu's read lock and unlock: a program that also takes liburcu's read lock
// itself shares one nesting count with grace's guards, in either order.
TEST(ReadGuard, ALiburcuReadLockAroundAGuardHoldsGracePeriodsAfterTheGuardEnds) {
  grace::domain d;
  expect_synchronize_waits_for(d, [](const section_body& body) {
    { auto registers_this_thread = grace::pin(); }
    urcu_memb_read_lock();
    { auto inner = grace::pin(); }
    EXPECT_TRUE(urcu_memb_read_ongoing());
    body();
    urcu_memb_read_unlock();
  });
}

TEST(ReadGuard, AGuardAroundALiburcuReadLockHoldsGracePeriodsAfterTheLockEnds) {
  grace::domain d;
  expect_synchronize_waits_for(d, [](const section_body& body) {
    auto outer = grace::pin();
    urcu_memb_read_lock();
    urcu_memb_read_unlock();
    EXPECT_TRUE(urcu_memb_read_ongoing());
    body();
  });
}

TEST(ReadGuard, TheProgramsOwnLiburcuReadLockCountsAsAReadSection) {
  { auto registers_this_thread = grace::pin(); }
  EXPECT_FALSE(grace::in_read_section());
  urcu_memb_read_lock();
  EXPECT_TRUE(grace::in_read_section());
  urcu_memb_read_unlock();
  EXPECT_FALSE(grace::in_read_section());
}

TEST(ReadGuard, SynchronizeAndBarrierInsideTheProgramsOwnLiburcuReadLockThrowInsteadOfWaiting) {
  grace::domain d;
  { auto registers_this_thread = grace::pin(); }
  gt::watchdog dog(kNoDeadlock, "synchronize() inside the program's own liburcu read lock");
  urcu_memb_read_lock();
  EXPECT_THROW(d.synchronize(), std::logic_error);
  EXPECT_THROW(d.barrier(), std::logic_error);
  urcu_memb_read_unlock();
}

TEST(ReadGuard, AThreadThatOnlyLiburcuKnowsCountsItsReadLockAsAReadSection) {
  grace::domain d;
  std::thread only_liburcu([&d] {
    urcu_memb_register_thread();  // the program's own registration; grace never pins here
    urcu_memb_read_lock();
    EXPECT_TRUE(grace::in_read_section());
    {
      gt::watchdog dog(kNoDeadlock, "synchronize() inside liburcu's read lock, unpinned thread");
      EXPECT_THROW(d.synchronize(), std::logic_error);
    }
    urcu_memb_read_unlock();
    EXPECT_FALSE(grace::in_read_section());
    urcu_memb_unregister_thread();
  });
  only_liburcu.join();
}

TEST(ReadGuard, AFirstGuardOnAThreadTheProgramRegisteredWithLiburcuAbortsNamingIt) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        std::thread registered_by_the_program([] {
          urcu_memb_register_thread();
          auto g = grace::pin();
        });
        registered_by_the_program.join();
      },
      "already registered with liburcu");
}

TEST(ReadGuard, AGraceWaitDueAtAGuardsEndInsideTheProgramsLiburcuReadLockWaitsForTheNextGuard) {
  grace::domain d;
  { auto registers_this_thread = grace::pin(); }
  gt::watchdog dog(kNoDeadlock, "a deferred grace period inside liburcu's read lock");
  const auto before = d.stats().grace_periods;
  urcu_memb_read_lock();
  {
    auto g = grace::pin();
    d.synchronize_when_unpinned();
  }  // would wait for the section around it
  urcu_memb_read_unlock();
  { auto next = grace::pin(); }  // its end runs the grace period that was due
  EXPECT_GT(d.stats().grace_periods, before);
}

TEST(ReadGuard, DomainPinHoldsGracePeriods) {
  grace::domain d;
  expect_synchronize_waits_for(d, [&d](const section_body& body) {
    auto g = d.pin();
    body();
  });
}

TEST(ReadGuard, ScopedLockOnADomainHoldsGracePeriods) {
  grace::domain d;
  expect_synchronize_waits_for(d, [&d](const section_body& body) {
    std::scoped_lock<grace::domain> lock(d);
    body();
  });
}

TEST(ReadGuard, GuardOnOneDomainHoldsGracePeriodsOfEveryDomain) {
  grace::domain pinned_domain;
  grace::domain other_domain;
  expect_synchronize_waits_for(other_domain, [&pinned_domain](const section_body& body) {
    auto g = pinned_domain.pin();
    body();
  });
  expect_synchronize_waits_for(grace::domain::global(), [&pinned_domain](const section_body& body) {
    auto g = pinned_domain.pin();
    body();
  });
}

// Objects retired into different domains after a reader pinned are all reclaimed only after
// that reader left: one guard protects every domain.
struct watched_object {
  std::shared_ptr<const std::atomic<bool>> reader_leaving;
  std::atomic<int>* reclaimed_early;
  std::atomic<int>* reclaimed;
};

void reclaim_watched(void* p) {
  auto* object = static_cast<watched_object*>(p);
  // Acquire: pairs with the reader's Release store of its mark made right before its guard
  // ended; a grace period that waited for the reader makes it visible.
  if (!object->reader_leaving->load(std::memory_order_acquire)) {
    object->reclaimed_early->fetch_add(1, std::memory_order_relaxed);  // Relaxed: a tally.
  }
  object->reclaimed->fetch_add(1, std::memory_order_relaxed);  // Relaxed: read after barrier().
  delete object;
}

TEST(ReadGuard, OneGuardProtectsObjectsOfEveryDomain) {
  std::atomic<int> reclaimed_early{0};
  std::atomic<int> reclaimed{0};
  grace::domain first({.drain_interval = 1ms});
  grace::domain second({.drain_interval = 1ms, .batching = grace::batching::per_object});
  grace::domain& global = grace::domain::global();

  // Its hold gives a broken engine time to reclaim early.
  gt::lingering_reader reader(kHold);
  reader.wait_until_inside();
  for (grace::domain* d : {&first, &second, &global}) {
    d->retire(new watched_object{reader.leaving(), &reclaimed_early, &reclaimed},
              &reclaim_watched, sizeof(watched_object));
  }
  reader.go();
  {
    gt::watchdog dog(kNoDeadlock, "barrier() on three domains");
    first.barrier();
    second.barrier();
    global.barrier();
  }
  reader.join();
  EXPECT_EQ(reclaimed.load(std::memory_order_relaxed), 3);  // Relaxed: after barrier().
  EXPECT_EQ(reclaimed_early.load(std::memory_order_relaxed), 0)
      << "an object was reclaimed while a reader that pinned before its retire was inside";
}

TEST(ReadGuard, ThreadsThatPinnedAndExitedDoNotHoldUpGracePeriods) {
  grace::domain d;
  for (int wave = 0; wave < 4; ++wave) {
    gt::run_threads(8, [](unsigned) {
      for (int i = 0; i < 100; ++i) {
        auto outer = grace::pin();
        auto inner = grace::pin();
      }
    });
  }
  gt::watchdog dog(kNoDeadlock, "synchronize() after 32 reader threads exited");
  for (int i = 0; i < 10; ++i) d.synchronize();
  // And a thread created after them still registers and holds grace periods.
  expect_synchronize_waits_for(d, [](const section_body& body) {
    auto g = grace::pin();
    body();
  });
}

// A thread that ends with a guard still held (here one built in static storage and never
// destroyed) would otherwise hold up every grace period of the process for good: its exit
// ends the section and says so.
TEST(ReadGuard, AThreadThatExitsInsideAReadSectionEndsItAndSaysSo) {
  grace::domain d;
  ::testing::internal::CaptureStderr();
  std::thread leaker([] {
    alignas(grace::read_guard) static unsigned char storage[sizeof(grace::read_guard)];
    new (storage) grace::read_guard;  // never destroyed: the thread exits inside the section
    auto nested = grace::pin();
  });
  leaker.join();
  const std::string said = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(said.find("a thread exited inside a read section (1 read_guard(s) still held)"),
            std::string::npos)
      << "stderr was: " << said;
  gt::watchdog dog(kNoDeadlock, "synchronize() after a thread exited inside a read section");
  for (int i = 0; i < 10; ++i) d.synchronize();
}

TEST(ReadGuard, SynchronizeWaitsForEveryReaderInsideWhenItStarts) {
  grace::domain d;
  constexpr unsigned kReaders = 4;
  std::atomic<unsigned> inside{0};
  std::atomic<bool> synchronizing{false};
  std::atomic<unsigned> leaving{0};
  std::vector<std::thread> readers;
  for (unsigned r = 0; r < kReaders; ++r) {
    readers.emplace_back([&, r] {
      auto g = grace::pin();
      // Release: pairs with the Acquire spin below (only gates the sequence).
      inside.fetch_add(1, std::memory_order_release);
      // Acquire: pairs with the Release store of `synchronizing`.
      while (!synchronizing.load(std::memory_order_acquire)) std::this_thread::yield();
      std::this_thread::sleep_for(kHold * (r + 1) / kReaders);  // leave one after another
      // Release: last act inside the section; pairs with the Acquire load after synchronize().
      leaving.fetch_add(1, std::memory_order_release);
    });
  }
  // Acquire: pairs with each reader's Release increment of `inside`.
  while (inside.load(std::memory_order_acquire) != kReaders) std::this_thread::yield();
  {
    gt::watchdog dog(kNoDeadlock, "synchronize() with four readers inside");
    // Release: pairs with the readers' Acquire spin.
    synchronizing.store(true, std::memory_order_release);
    d.synchronize();
  }
  // Acquire: pairs with each reader's Release increment of `leaving`.
  const unsigned left = leaving.load(std::memory_order_acquire);
  for (std::thread& reader : readers) reader.join();
  EXPECT_EQ(left, kReaders) << "synchronize() returned while a reader was still inside";
}

}  // namespace
