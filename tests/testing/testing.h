// Test helpers shared by every grace suite (test-only; never linked into the library).
//
//   namespace gt = grace::testing;
//   gt::run_threads(4, [&](unsigned index) { ... });      // released together
//   const std::size_t n = gt::iterations(100'000);         // smaller under sanitizers
//   gt::instance_tracker tracker(n);
//   d.retire(new gt::tracked(tracker, id));
//   d.barrier();
//   EXPECT_TRUE(tracker.each_destroyed_once(0, n));
//
// What is here:
//   - iterations(): an iteration budget, divided under sanitizers.
//   - start_barrier, run_threads(): release worker threads at the same instant.
//   - watchdog: aborts the test binary with a message if a scope does not finish in time
//     (turns a deadlock into a failure that names what hung).
//   - eventually(): polls a condition until it holds or a timeout passes.
//   - guard_holder: a thread that holds a read section until released.
//   - lingering_reader: a thread that stays in a read section a while after the test's
//     go-ahead, then marks that it leaves: for calls that must wait for earlier readers.
//   - failing_allocator: a grace::system_allocator that fails the Nth allocation, or every
//     allocation while a flag is set, and counts what is live.
//   - mapping_allocator: a grace::system_allocator that never calls malloc (fork tests).
//   - instance_tracker and tracked: objects with a canary that count their destruction per id.
//   - current_rss_bytes(): resident set size from /proc/self/statm.
//   - rejects_options(): an options check that throws std::invalid_argument naming the
//     option.
#pragma once

#include <gtest/gtest.h>
#include <sched.h>
#include <signal.h>
#include <sys/types.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <latch>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "grace/reclaim/system_allocator.h"

// GRACE_TESTING_SANITIZED is 1 under AddressSanitizer, ThreadSanitizer or MemorySanitizer
// (GCC defines __SANITIZE_*__; Clang answers __has_feature).
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define GRACE_TESTING_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || \
    __has_feature(memory_sanitizer)
#define GRACE_TESTING_SANITIZED 1
#endif
#endif
#ifndef GRACE_TESTING_SANITIZED
#define GRACE_TESTING_SANITIZED 0
#endif
// GRACE_TESTING_ASAN is 1 under AddressSanitizer: for tests of what only ASan can catch.
#if defined(__SANITIZE_ADDRESS__)
#define GRACE_TESTING_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define GRACE_TESTING_ASAN 1
#endif
#endif
#ifndef GRACE_TESTING_ASAN
#define GRACE_TESTING_ASAN 0
#endif
// GRACE_TESTING_TSAN is 1 under ThreadSanitizer alone: tests of what TSan cannot run, such
// as threads started in the child of a multi-threaded fork() (GCC 12's libtsan dies there),
// are compiled only without it, so no registered test skips itself.
#if defined(__SANITIZE_THREAD__)
#define GRACE_TESTING_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define GRACE_TESTING_TSAN 1
#endif
#endif
#ifndef GRACE_TESTING_TSAN
#define GRACE_TESTING_TSAN 0
#endif

namespace grace::testing {

// ---------------------------------------------------------------------------------------------
// Iteration budgets.

inline constexpr bool kSanitized = GRACE_TESTING_SANITIZED != 0;
// Sanitized builds run this many times fewer iterations (they are 3-10x slower per operation,
// and a 2-core CI machine must finish the asan preset in minutes).
inline constexpr std::size_t kSanitizerDivisor = 8;

// `plain` in a plain build, plain / kSanitizerDivisor under sanitizers; never below 1.
std::size_t iterations(std::size_t plain) noexcept;
// `plain` in a plain build, `sanitized` under sanitizers; never below 1. For loops whose
// every iteration a sanitizer checks for something the plain build cannot see (a
// use-after-free of a reclaimed object), where a smaller cut buys more coverage.
std::size_t iterations(std::size_t plain, std::size_t sanitized) noexcept;

// ---------------------------------------------------------------------------------------------
// Starting threads together.

// Every participant blocks in arrive_and_wait() until all `parties` have arrived, so the
// threads' work overlaps instead of running one after another as they are created.
class start_barrier {
 public:
  explicit start_barrier(std::ptrdiff_t parties) : latch_(parties) {}
  start_barrier(const start_barrier&) = delete;
  start_barrier& operator=(const start_barrier&) = delete;

  void arrive_and_wait() noexcept { latch_.arrive_and_wait(); }

 private:
  std::latch latch_;
};

// Runs fn(0) ... fn(count - 1) on `count` new threads released together by a start_barrier,
// and joins them all.
template <class Fn>
void run_threads(unsigned count, Fn fn) {
  start_barrier start(count);
  std::vector<std::thread> threads;
  threads.reserve(count);
  for (unsigned i = 0; i < count; ++i) {
    threads.emplace_back([&start, &fn, i] {
      start.arrive_and_wait();
      fn(i);
    });
  }
  for (std::thread& thread : threads) thread.join();
}

// ---------------------------------------------------------------------------------------------
// Deadlocks and polling.

// Aborts the process (naming `what`) unless it is destroyed within `timeout`. A test that
// could deadlock creates one around the call that must return:
//   { gt::watchdog dog(20s, "retire() past the hard limit inside a read section");
//     ... }
class watchdog {
 public:
  watchdog(std::chrono::milliseconds timeout, std::string what);
  ~watchdog();
  watchdog(const watchdog&) = delete;
  watchdog& operator=(const watchdog&) = delete;

 private:
  std::mutex mutex_;
  std::condition_variable done_cv_;
  bool started_ = false;  // the thread runs (the constructor waits for it)
  bool done_ = false;
  std::string what_;
  std::thread thread_;
};

// Polls `condition` (every ~1 ms) until it returns true or `timeout` passes; returns its last
// value. For conditions that must come true eventually, not for ordering.
bool eventually(const std::function<bool()>& condition, std::chrono::milliseconds timeout);

// A thread that holds a read_guard from start() until release() (or destruction): no grace
// period that begins after start() returns can end before release().
class guard_holder {
 public:
  guard_holder() = default;
  guard_holder(const guard_holder&) = delete;
  guard_holder& operator=(const guard_holder&) = delete;
  ~guard_holder();

  void start();    // returns once the thread is inside its read section
  void release();  // lets it leave, and joins it

 private:
  std::thread thread_;
  std::atomic<bool> inside_{false};
  std::atomic<bool> leave_{false};
};

// A thread that enters a read section, waits there until the test has called go() `goes`
// times, lingers `hold` longer (widening the window in which a call that should wait for it
// returns early, or an object it can see is reclaimed), and, as its last act inside, marks
// that it is leaving. The test starts the call that must wait after wait_until_inside()
// and go(); left_section() false after that call returns means it did not wait.
class lingering_reader {
 public:
  // Enters a read section in some way and calls body() inside it.
  using section = std::function<void(const std::function<void()>& body)>;
  // Starts the thread; `enter` defaults to a grace::pin() guard.
  explicit lingering_reader(std::chrono::milliseconds hold, unsigned goes = 1,
                            section enter = {});
  lingering_reader(const lingering_reader&) = delete;
  lingering_reader& operator=(const lingering_reader&) = delete;
  ~lingering_reader();  // lets the reader go if the test has not, and joins

  void wait_until_inside() const;  // returns once the reader is inside its section
  void go();                       // one of the `goes` the reader waits for
  bool left_section() const;       // whether the reader has marked that it is leaving
  // The mark itself, for an object whose reclaim checks that the reader had left; shared,
  // so that an object a domain reclaims after the reader is gone still finds it.
  std::shared_ptr<const std::atomic<bool>> leaving() const { return leaving_; }
  void join();

 private:
  std::atomic<bool> inside_{false};
  std::atomic<unsigned> goes_{0};
  std::shared_ptr<std::atomic<bool>> leaving_ = std::make_shared<std::atomic<bool>>(false);
  std::thread thread_;
};

// ---------------------------------------------------------------------------------------------
// A system_allocator that fails on demand.

// Hands out malloc (or posix_memalign) memory through grace::system_allocator and fails
// allocations when asked: the Nth allocation (once), or every allocation while
// fail_all(true) is in force. Counts attempts, failures and what is live, so a test can also
// check that every block was returned with the size it was allocated with. Thread-safe; must
// outlive every user of get().
class failing_allocator {
 public:
  failing_allocator() = default;
  failing_allocator(const failing_allocator&) = delete;
  failing_allocator& operator=(const failing_allocator&) = delete;

  // The allocator to put in options (its context points at *this).
  grace::system_allocator get() noexcept;

  // While on, every allocation returns nullptr.
  void fail_all(bool on) noexcept;
  // The n-th allocation attempt from now (n >= 1) fails, once. n == 0 cancels.
  void fail_nth(std::uint64_t n) noexcept;

  std::uint64_t attempts() const noexcept;
  std::uint64_t failures() const noexcept;
  // Allocations not yet deallocated, and the bytes they were asked for.
  std::int64_t live_allocations() const noexcept;
  std::int64_t live_bytes() const noexcept;

 private:
  static void* allocate(std::size_t bytes, std::size_t alignment, void* context) noexcept;
  static void deallocate(void* memory, std::size_t bytes, void* context) noexcept;

  std::atomic<bool> fail_all_{false};
  std::atomic<std::uint64_t> fail_at_{0};  // attempt number that fails; 0 = none
  std::atomic<std::uint64_t> attempts_{0};
  std::atomic<std::uint64_t> failures_{0};
  std::atomic<std::int64_t> live_allocations_{0};
  std::atomic<std::int64_t> live_bytes_{0};
};

// Every request mapped on its own (page-granular, aligned by trimming an over-sized mapping):
// never calls malloc. For fork() tests under AddressSanitizer, whose allocator (GCC 12) takes
// no lock around fork(): a child whose parent had another thread inside malloc at the copy
// can deadlock in its own malloc, so threads that run at the fork use this.
extern const grace::system_allocator mapping_allocator;

// ---------------------------------------------------------------------------------------------
// Instance tracking.

// Counts constructions and destructions of `tracked` objects, per id in [0, ids) and in
// total, and destructions that found the canary already poisoned (a second destruction).
class instance_tracker {
 public:
  explicit instance_tracker(std::size_t ids = 0);
  instance_tracker(const instance_tracker&) = delete;
  instance_tracker& operator=(const instance_tracker&) = delete;

  std::uint64_t constructed() const noexcept;
  std::uint64_t destroyed() const noexcept;
  std::int64_t live() const noexcept;
  // Destructions that found a poisoned or corrupt canary.
  std::uint64_t corrupt_destructions() const noexcept;
  // How many times the object with this id was destroyed (id < ids).
  std::uint32_t destroyed_count(std::size_t id) const noexcept;

  // Success iff every id in [first, last) was destroyed exactly once (names the first that
  // was not, and how many are off).
  ::testing::AssertionResult each_destroyed_once(std::size_t first, std::size_t last) const;
  // Success iff no id in [first, last) has been destroyed yet.
  ::testing::AssertionResult none_destroyed(std::size_t first, std::size_t last) const;

 private:
  friend class tracked;
  void on_construct() noexcept;
  void on_destroy(std::size_t id, bool canary_intact) noexcept;

  std::size_t ids_;
  std::unique_ptr<std::atomic<std::uint32_t>[]> per_id_;
  std::atomic<std::uint64_t> constructed_{0};
  std::atomic<std::uint64_t> destroyed_{0};
  std::atomic<std::uint64_t> corrupt_{0};
};

// An object with a canary. The destructor checks the canary, overwrites it with a poison
// value (so a reader that still holds the object sees it was reclaimed), and tells the
// tracker. Readers call intact() concurrently with nothing but other readers.
class tracked {
 public:
  static constexpr std::uint64_t kAlive = 0x600dc0de600dc0deULL;
  static constexpr std::uint64_t kPoison = 0xdeadbeefdeadbeefULL;

  tracked(instance_tracker& tracker, std::size_t id) noexcept;
  ~tracked();
  tracked(const tracked&) = delete;
  tracked& operator=(const tracked&) = delete;

  std::size_t id() const noexcept { return id_; }
  // True while the object has not been destroyed.
  bool intact() const noexcept {
    // Relaxed: a canary, compared by value only; an early reclaim is what the test detects.
    return canary_.load(std::memory_order_relaxed) == kAlive;
  }

 private:
  std::atomic<std::uint64_t> canary_{kAlive};
  instance_tracker* tracker_;
  std::size_t id_;
};

// ---------------------------------------------------------------------------------------------
// Options checks.

// Succeeds iff build() throws std::invalid_argument whose message names `option`; `built`
// says what build() makes, for the message when it accepts the options ("the pool").
template <class Build>
::testing::AssertionResult rejects_options(Build&& build, std::string_view option,
                                           std::string_view built) {
  try {
    build();
  } catch (const std::invalid_argument& e) {
    if (std::string_view(e.what()).find(option) != std::string_view::npos) {
      return ::testing::AssertionSuccess();
    }
    return ::testing::AssertionFailure()
           << "std::invalid_argument(\"" << e.what() << "\") does not name " << option;
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "threw something else: " << e.what();
  }
  return ::testing::AssertionFailure() << built << " accepted the options";
}

// ---------------------------------------------------------------------------------------------
// Memory.

// The process's resident set size now, in bytes (/proc/self/statm); 0 if unreadable.
std::size_t current_rss_bytes();
// The process's mapped address space now, in bytes (/proc/self/statm), what RLIMIT_AS
// limits; 0 if unreadable.
std::size_t current_address_space_bytes();

// ---------------------------------------------------------------------------------------------
// Threads of this process (/proc/self/task).

// The kernel's id of the calling thread.
pid_t this_thread_id() noexcept;
// A thread's nice value, from /proc/self/task/<tid>/stat; INT_MIN if unreadable.
int thread_nice(pid_t tid);
// Every thread of this process named `name` (pthread_setname_np), with its nice value.
std::map<pid_t, int> threads_named(std::string_view name);
// The same, without the threads in `before` (an earlier threads_named()): the ones started
// since.
std::map<pid_t, int> threads_named_since(std::string_view name,
                                         const std::map<pid_t, int>& before);

// ---------------------------------------------------------------------------------------------
// fork().

// waitpid() that retries on EINTR: the status, or -1.
int wait_for_child(pid_t pid) noexcept;

// Keeps the calling thread on `cpu` from now on; false if it could not.
bool pin_to_cpu(int cpu);
// Puts the calling thread back on the CPUs it was allowed when this was built.
class saved_affinity {
 public:
  saved_affinity();
  ~saved_affinity();
  saved_affinity(const saved_affinity&) = delete;
  saved_affinity& operator=(const saved_affinity&) = delete;

 private:
  cpu_set_t allowed_;
  bool saved_;
};
// Moves threads between the CPUs this process may run on and signals them (SIGURG, whose
// handler does nothing), so that the kernel restarts any restartable sequence they are in.
// The handler is installed, and the caller's affinity saved, for the disturber's lifetime.
// Each thread must not have finished while it is disturbed: glibc turns the handle of a
// finished thread into the caller's own.
class cpu_disturber {
 public:
  cpu_disturber();
  ~cpu_disturber();
  cpu_disturber(const cpu_disturber&) = delete;
  cpu_disturber& operator=(const cpu_disturber&) = delete;

  // Moves each of `threads` to a CPU (another one each round) and signals it; EXPECTs that
  // both calls succeed.
  void disturb(std::vector<std::thread>& threads);
  std::uint64_t disturbances() const noexcept { return disturbances_; }

 private:
  saved_affinity restore_;
  struct sigaction previous_ {};
  bool installed_ = false;
  std::vector<int> cpus_;
  std::size_t round_ = 0;
  std::uint64_t disturbances_ = 0;
};

// Two CPUs this process may run on whose per-CPU shards differ (pool caches, map counters
// and retire shards are indexed by CPU number modulo their power-of-two count), or
// {-1, -1}.
std::array<int, 2> two_cpus_with_their_own_shards();

// Runs child() in a fork()ed child that _exit()s with child()'s return value, and is killed
// by SIGALRM if it still runs after `alarm_seconds`; returns the child's wait status, or -1
// if fork() or waitpid() failed. In the child, report failures through the return value and
// stderr, never through gtest assertions.
template <class Fn>
int run_in_child(Fn child, unsigned alarm_seconds = 60) {
  const pid_t pid = ::fork();
  if (pid < 0) return -1;
  if (pid == 0) {
    ::alarm(alarm_seconds);
    const int code = child();
    std::fflush(stderr);
    ::_exit(code);
  }
  return wait_for_child(pid);
}
// Success if `status` (from run_in_child) says the child exited with 0; otherwise says how it
// ended (an exit code, or a signal: SIGALRM means it hung).
::testing::AssertionResult exited_cleanly(int status);

// In a child of run_in_child(): prints what failed, with a number that locates it (a key, an
// index), and returns `code`, the child's exit status.
int child_failure(int code, const char* what, std::uint64_t detail);

// Forks `forks` times while the caller's other threads keep working, each time after a random
// pause below `max_pause` (a fixed seed), under a watchdog of `budget` named `what`. Each child
// runs child() (run_in_child, killed after `alarm_seconds`) and must exit cleanly.
template <class Fn>
void fork_at_random_moments(int forks, std::chrono::microseconds max_pause,
                            unsigned alarm_seconds, std::chrono::milliseconds budget,
                            const std::string& what, Fn child) {
  std::minstd_rand random(20261130);
  watchdog dog(budget, what);
  for (int i = 0; i < forks; ++i) {
    std::this_thread::sleep_for(std::chrono::microseconds(random() % max_pause.count()));
    ASSERT_TRUE(exited_cleanly(run_in_child(child, alarm_seconds)))
        << "fork " << i << " of " << forks;
  }
}

}  // namespace grace::testing
