// grace::object_pool's chunk lock (alloc/include/grace/alloc/detail/magazine.h, (P5)/(P6)):
// a thread parked while holding it (through the detail::chunk_lock_held_hook test seam)
// shows that releases made meanwhile are deferred to it and freed when it lets go, and that
// the child of a fork() taken while a thread of the parent held it takes the lock over
// instead of deferring to a thread it does not have.
//
// Fork conventions as in tests/map/hash_map_fork_test.cc: the child runs a function whose
// int result is its exit code (0 = passed; each failure prints a line and has its own code)
// and ends with _exit(); alarm() turns a hang in the child into SIGALRM.
#include <gtest/gtest.h>
#include <pthread.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <memory>
#include <thread>
#include <vector>

#include "grace/alloc/object_pool.h"
#include "grace/reclaim/domain.h"
#include "tests/alloc/object_pool_testing.h"
#include "tests/testing/testing.h"

namespace {

namespace gt = grace::testing;
namespace ga = grace::testing::alloc;
using namespace std::chrono_literals;
using ga::describe;

constexpr std::size_t kObjectSize = 1024;  // 63 a chunk
constexpr std::size_t kPerChunk = 63;

// Small magazines, no grace period run by deallocating threads: a few hundred objects go
// through every stage, and a shed reaches the chunks within a round.
grace::pool_options small_pool() {
  grace::pool_options o;
  o.low_watermark = 0;
  o.high_watermark = 4;
  o.batch = 4;
  o.magazine_capacity = 4;
  o.caller_gp_threshold = 0;
  return o;
}

// Objects the depot can take (16 magazines a cache): frees beyond them reach the chunks.
std::size_t depot_objects() {
  return 16 * grace::detail::cpu_shard_count() * small_pool().batch;
}

// The hook parks the thread that set tl_parks, once per arming, while it holds the lock.
std::atomic<bool> park_armed{false};
std::atomic<bool> parked{false};
std::atomic<bool> unpark{false};
thread_local bool tl_parks = false;

void park_while_holding_the_chunk_lock() {
  // SeqCst throughout: test signalling, not on any measured path.
  if (!tl_parks || !park_armed.exchange(false)) return;
  parked.store(true);
  while (!unpark.load()) std::this_thread::sleep_for(1ms);
}

class ObjectPoolChunkLock : public ::testing::Test {
 protected:
  void SetUp() override {
    park_armed.store(false);
    parked.store(false);
    unpark.store(false);
    // Relaxed: set before the threads that call it start.
    grace::detail::chunk_lock_held_hook.store(&park_while_holding_the_chunk_lock,
                                              std::memory_order_relaxed);
  }
  void TearDown() override {
    grace::detail::chunk_lock_held_hook.store(nullptr, std::memory_order_relaxed);
  }
};

// Allocates n objects, frees all but 4, waits for a grace period, frees the last 4: the
// slow path of those frees promotes what waited and sheds the surplus to its chunks.
void churn_round(grace::object_pool& pool, grace::domain& d, std::size_t n) {
  std::vector<void*> objects(n);
  for (void*& p : objects) p = pool.allocate();
  for (std::size_t i = 0; i + 4 < n; ++i) pool.deallocate(objects[i]);
  d.synchronize();
  for (std::size_t i = n - 4; i < n; ++i) pool.deallocate(objects[i]);
}

// Starts a thread that fills 30 chunks and, with the hook armed, frees them: it parks at its
// first hold of the chunk lock. Returns once it is parked (or fails the test).
std::thread park_a_holder(grace::object_pool& pool, grace::domain& d) {
  std::thread holder([&] {
    tl_parks = true;
    std::vector<void*> objects(std::max<std::size_t>(30 * kPerChunk, 2 * depot_objects()));
    for (void*& p : objects) p = pool.allocate();
    park_armed.store(true);
    for (std::size_t i = 0; i + 4 < objects.size(); ++i) pool.deallocate(objects[i]);
    d.synchronize();
    for (std::size_t i = objects.size() - 4; i < objects.size(); ++i) {
      pool.deallocate(objects[i]);
    }
  });
  EXPECT_TRUE(gt::eventually([] { return parked.load(); }, 30s))
      << "the thread never held the chunk lock";
  return holder;
}

TEST_F(ObjectPoolChunkLock, ReleasesMadeWhileAnotherThreadHoldsItAreFreedWhenItLetsGo) {
  grace::domain d;  // its drain timer runs the idle trim
  grace::object_pool pool(kObjectSize, small_pool(), d);
  std::thread holder = park_a_holder(pool, d);
  // Every release now finds the lock held and is deferred to the parked thread.
  for (int round = 0; round < 10; ++round) churn_round(pool, d, 10 * kPerChunk);
  const grace::pool_stats during = pool.stats();
  unpark.store(true);
  holder.join();
  // With the holder gone, nothing may stay deferred: the trim and every later hold free
  // what is left, down to the few objects the caches keep (1 chunk per cache at most, plus
  // the chunk each is cutting).
  const std::size_t bound = 2 * grace::detail::cpu_shard_count();
  grace::pool_stats s;
  EXPECT_TRUE(gt::eventually(
      [&] {
        s = pool.stats();
        return s.chunks <= bound;
      },
      10s))
      << "chunks stayed held: " << s.chunks << " (bound " << bound << "; " << during.chunks
      << " while the lock was held): " << describe(s);
  EXPECT_EQ(s.allocated, s.deallocated) << describe(s);
}

// Compiled without TSan only: the child starts threads (its domain's engine), which GCC 12's
// libtsan does not support in the child of a multithreaded process.
#if !GRACE_TESTING_TSAN
grace::domain_options quiet() {
  grace::domain_options o;
  o.drain_interval = 10s;  // the drain timer never fires
  return o;
}

// In the child: prints what failed and returns `code`.
int child_failure(int code, const char* what, const grace::pool_stats& s) {
  std::fprintf(stderr, "child: %s: %s\n", what, describe(s).c_str());
  return code;
}

int child_keeps_reusing_chunks(std::unique_ptr<grace::object_pool> pool, grace::domain& d) {
  alarm(60);
  const grace::pool_stats before = pool->stats();
  for (int round = 0; round < 20; ++round) churn_round(*pool, d, 1000);
  const grace::pool_stats after = pool->stats();
  if (after.reused_from_chunks == before.reused_from_chunks) {
    return child_failure(2, "no free slot of a chunk was handed out again", after);
  }
  // One round needs 16 chunks; deferring to the parent's thread instead cut ~14 a round
  // (~280 in all). Reuse keeps the growth to a few rounds' worth: under CI's load (asan, two
  // suites at once) the child once grew by 24, a round whose objects were not yet back
  // cutting afresh; the bound allows four such rounds.
  if (after.chunks > before.chunks + 4 * (1000 / kPerChunk + 1) + 2) {
    return child_failure(3, "the chunks kept growing", after);
  }
  // The parked thread's objects are allocated in this process for ever.
  pool->forget_allocated();
  pool.reset();
  return 0;
}

// A thread of the parent holds the chunk lock at the copy. fork() holds every pool cache
// itself (alloc/src/object_pool.cc, "fork()"), so only a thread outside any cache hold can:
// one in the all-caches-held fallback. So every cache is held first, by threads parked
// inside the pool's system_allocator (under their hold) until a thread has parked in the
// fallback, holding the chunk lock. The fork waits for the cache holders, not for it.
std::atomic<int> cache_park_budget{0};  // SeqCst throughout: test signalling
std::atomic<int> cache_holders_parked{0};
thread_local bool tl_parked_in_allocator = false;

void* allocate_parking_once(std::size_t bytes, std::size_t alignment, void* context) noexcept {
  if (!tl_parked_in_allocator) {
    int budget = cache_park_budget.load();
    while (budget > 0 && !cache_park_budget.compare_exchange_weak(budget, budget - 1)) {
    }
    if (budget > 0) {
      tl_parked_in_allocator = true;
      cache_holders_parked.fetch_add(1);
      // Until the fallback thread holds the chunk lock (while every cache is held), then a
      // little more: the fork then waits for these holds, and for them only.
      while (!parked.load()) std::this_thread::sleep_for(1ms);
      std::this_thread::sleep_for(100ms);
    }
  }
  return grace::system_allocator::malloc_allocate(bytes, alignment, context);
}

TEST_F(ObjectPoolChunkLock, TheChildOfAForkTakesOverTheLockAThreadOfTheParentHeld) {
  grace::domain d(quiet());
  grace::pool_options options = small_pool();
  options.allocator = {&allocate_parking_once, &grace::system_allocator::malloc_deallocate,
                       nullptr};
  auto pool = std::make_unique<grace::object_pool>(kObjectSize, options, d);
  const unsigned caches = grace::detail::cpu_shard_count();
  cache_park_budget.store(static_cast<int>(caches));
  std::vector<std::thread> cache_holders;
  std::vector<void*> held_objects(caches + 1);
  std::atomic<bool> forked{false};  // SeqCst: test signalling
  for (unsigned k = 0; k < caches; ++k) {
    cache_holders.emplace_back([&, k] {
      held_objects[k] = pool->allocate();
      // Not ending (and freeing this thread's state) while the fork copies: under ASan no
      // thread may be inside malloc at the copy.
      while (!forked.load()) std::this_thread::sleep_for(1ms);
    });
    ASSERT_TRUE(gt::eventually([&] { return cache_holders_parked.load() > static_cast<int>(k); },
                               30s))
        << "no thread parked holding cache " << k;
  }
  // Every cache is held: this allocate() takes the fallback, and parks holding the lock.
  std::thread holder([&] {
    tl_parks = true;
    park_armed.store(true);
    held_objects[caches] = pool->allocate();
  });
  ASSERT_TRUE(gt::eventually([] { return parked.load(); }, 30s))
      << "the thread never held the chunk lock";
  const pid_t child = fork();
  ASSERT_NE(child, -1);
  if (child == 0) _exit(child_keeps_reusing_chunks(std::move(pool), d));
  forked.store(true);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  unpark.store(true);
  holder.join();
  for (std::thread& t : cache_holders) t.join();
  EXPECT_TRUE(WIFEXITED(status)) << "the child died of signal " << WTERMSIG(status);
  EXPECT_EQ(WEXITSTATUS(status), 0) << "the child failed (its stderr says how)";
  for (void* object : held_objects) pool->deallocate(object);
  // The parent's pool is unaffected.
  churn_round(*pool, d, 1000);
  const grace::pool_stats s = pool->stats();
  EXPECT_EQ(s.allocated, s.deallocated) << describe(s);
}

// The other way round: in the child, the domain's worker restarts (grace's fork handler) and
// runs a deleter that takes the chunk lock; the forking thread must then find it busy, not
// take it over as if a thread of the parent held it. Before the fork generation was bumped
// ahead of that restart, the worker took the lock under the parent's generation and the
// forking thread "took it over" while the worker still held it (a slot handed out twice, a
// chunk freed twice). A pthread_atfork child handler registered after grace's (and before
// the pool exists) retires such a deleter in the child and holds fork() back there until
// the worker is parked inside its hold.
std::atomic<grace::domain*> fork_domain{nullptr};
std::atomic<int> threads_inside_the_lock{0};
std::atomic<bool> two_inside_at_once{false};
thread_local bool tl_worker_deleter = false;
grace::object_pool* deleter_pool = nullptr;

void count_threads_inside_the_lock() {
  if (threads_inside_the_lock.fetch_add(1) != 0) two_inside_at_once.store(true);
  if (tl_worker_deleter && !parked.exchange(true)) {
    while (!unpark.load()) std::this_thread::sleep_for(1ms);
  }
  threads_inside_the_lock.fetch_sub(1);
}

// A retire() deleter: allocations that refill from chunks' free slots, under the lock.
void allocate_in_a_deleter(void*) {
  tl_worker_deleter = true;
  // Past what the caches and the depot hold, so a refill reaches the chunks. Left
  // allocated: the child ends.
  for (std::size_t i = 0; i < depot_objects() + 200 && !parked.load(); ++i) {
    deleter_pool->allocate();
  }
  tl_worker_deleter = false;
}

void park_the_worker_inside_the_lock() {
  grace::domain* d = fork_domain.load();
  if (d == nullptr) return;
  d->retire(nullptr, &allocate_in_a_deleter);
  for (int i = 0; i < 10'000 && !parked.load(); ++i) std::this_thread::sleep_for(1ms);
}

int child_never_takes_over_a_live_hold(grace::object_pool& pool) {
  alarm(60);
  if (!parked.load()) {
    std::fprintf(stderr, "child: the worker never took the chunk lock\n");
    return 2;
  }
  // The worker holds the lock under this process's generation: these find it busy, so
  // their refills cut new chunks and their releases are deferred to the worker.
  const grace::pool_stats before = pool.stats();
  std::vector<void*> objects(depot_objects() + 10 * kPerChunk);
  for (void*& p : objects) p = pool.allocate();
  for (void* p : objects) pool.deallocate(p);
  const grace::pool_stats after = pool.stats();
  unpark.store(true);
  if (after.fresh == before.fresh) {
    std::fprintf(stderr, "child: the forking thread never reached the chunks\n");
    return 4;
  }
  if (two_inside_at_once.load()) {
    std::fprintf(stderr, "child: two threads held the chunk lock at once\n");
    return 3;
  }
  return 0;
}

TEST_F(ObjectPoolChunkLock, TheChildNeverTakesOverALockItsOwnRestartedWorkerHolds) {
  grace::domain_options options;
  options.drain_interval = 5ms;
  grace::domain d(options);  // installs grace's fork handlers: ours runs after them
  static const int registered =
      pthread_atfork(nullptr, nullptr, &park_the_worker_inside_the_lock);
  ASSERT_EQ(registered, 0);
  grace::object_pool pool(kObjectSize, small_pool(), d);
  deleter_pool = &pool;
  // Chunks with free slots: every other object of 20 chunks freed, then shed to them.
  std::vector<void*> objects(20 * kPerChunk);
  for (void*& p : objects) p = pool.allocate();
  std::vector<void*> kept;
  for (std::size_t i = 0; i < objects.size(); ++i) {
    if (i % 2 == 0) {
      pool.deallocate(objects[i]);
    } else {
      kept.push_back(objects[i]);
    }
  }
  d.synchronize();
  for (int i = 0; i < 8; ++i) pool.deallocate(pool.allocate());
  grace::detail::chunk_lock_held_hook.store(&count_threads_inside_the_lock,
                                            std::memory_order_relaxed);
  struct arm_the_handler {
    explicit arm_the_handler(grace::domain& d) { fork_domain.store(&d); }
    ~arm_the_handler() { fork_domain.store(nullptr); }
  };
  pid_t child;
  {
    const arm_the_handler armed(d);
    child = fork();
    if (child == 0) _exit(child_never_takes_over_a_live_hold(pool));
  }
  ASSERT_NE(child, -1);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status)) << "the child died of signal " << WTERMSIG(status);
  EXPECT_EQ(WEXITSTATUS(status), 0) << "the child failed (its stderr says how)";
  grace::detail::chunk_lock_held_hook.store(nullptr, std::memory_order_relaxed);
  for (void* p : kept) pool.deallocate(p);
}
#endif

}  // namespace
