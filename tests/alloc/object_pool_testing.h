// Helpers shared by the object_pool tests (test-only).
//
//   reuse_oracle oracle(d);                   // the pool's guarantee, checked from outside
//   void* p = pool.allocate();  oracle.on_allocate(p);
//   oracle.on_deallocate(p);    pool.deallocate(p);
//   EXPECT_TRUE(oracle.clean());
//
//   churn(pool, oracle, {.threads = 2, .operations = n, .guards = guards::always});
//
// What is here:
//   - reuse_oracle: a side table (object address -> grace-period cookie) that fails when
//     allocate() hands out an object before a full grace period of the pool's domain has
//     elapsed since the test deallocated it, or hands out an object still allocated.
//   - churn(): threads that allocate, write, check and deallocate objects (singly, in bulk,
//     handed to another thread, inside read guards or not) with every call checked by a
//     reuse_oracle; churn_accounted(): what a churn() run must leave behind.
//   - spsc_ring: a bounded single-producer single-consumer queue of object pointers, and
//     produce_until() / consume_until(): the two ends of one, run until a stop flag is set.
//   - pin_to_current_cpu: keeps the calling thread on one CPU, so a single-threaded test
//     always meets the same per-CPU cache.
//   - fill_object / object_intact: every byte of an object set to one value, and checked.
//   - describe(pool_stats): every field, for failure messages.
//   - quiet(), small_magazines(), kHold, kNoDeadlock: the domain, pool options and timings
//     the tests share.
//   - rejects(): whether a pool's constructor throws std::invalid_argument naming an option.
#pragma once

#include <gtest/gtest.h>
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include "grace/alloc/object_pool.h"
#include "grace/reclaim/domain.h"
#include "grace/reclaim/read_guard.h"
#include "tests/testing/testing.h"

namespace grace::testing::alloc {

// ---------------------------------------------------------------------------------------------
// The guarantee, checked from outside.
//
// Why the cookie is taken right BEFORE deallocate(), not after: the pool seals an object's
// magazine (takes its own cookie) at some point after the object was added, possibly on
// another thread before our deallocate() call has even returned. A cookie we took after the
// call could then be newer than the pool's, and a correct reuse would look early. A cookie
// taken before the call is never newer than the pool's (the pool reads the same counter
// later, ordered by its cache hold), so gp_elapsed(our cookie) must hold at every reuse:
// the check never fails a correct pool. It still fails a pool that skips the wait, unless
// a whole grace period happens to begin in the few instructions between our cookie and the
// deallocate() call and end before the reuse (TheReuseOracleCatchesAPoolThatReusesAtOnce
// shows it does fail).
class reuse_oracle {
 public:
  explicit reuse_oracle(const grace::domain& reclamation) : domain_(reclamation) {}
  reuse_oracle(const reuse_oracle&) = delete;
  reuse_oracle& operator=(const reuse_oracle&) = delete;

  // Call right before pool.deallocate(object) (or once per object before deallocate_bulk).
  void on_deallocate(void* object) {
    const std::uint64_t cookie = domain_.gp_cookie();
    shard& s = shard_of(object);
    std::lock_guard lock(s.mutex);
    entry& e = s.entries[object];
    e.allocated = false;
    e.cookie = cookie;
  }

  // Call right after allocate() returned `object` (or once per object of allocate_bulk).
  void on_allocate(void* object) {
    shard& s = shard_of(object);
    std::string failure;
    {
      std::lock_guard lock(s.mutex);
      auto [it, first_time] = s.entries.try_emplace(object);
      entry& e = it->second;
      if (first_time) {
        e.allocated = true;
        // Relaxed: a tally, read after the threads are joined.
        fresh_.fetch_add(1, std::memory_order_relaxed);
        return;
      }
      if (e.allocated) {
        failure = "allocate() returned an object that is still allocated";
      } else if (!domain_.gp_elapsed(e.cookie)) {
        failure = "allocate() returned an object before a grace period had elapsed since "
                  "its deallocate()";
      }
      e.allocated = true;
      // Relaxed: a tally, read after the threads are joined.
      reuses_.fetch_add(1, std::memory_order_relaxed);
    }
    if (!failure.empty()) report(object, failure);
  }

  // Relaxed (all three): tallies, read after the threads that made the calls were joined.
  std::uint64_t reuses() const noexcept { return reuses_.load(std::memory_order_relaxed); }
  std::uint64_t fresh() const noexcept { return fresh_.load(std::memory_order_relaxed); }
  std::uint64_t violations() const noexcept {
    return violations_.load(std::memory_order_relaxed);
  }

  // Success iff no violation was seen; otherwise names the first and how many.
  ::testing::AssertionResult clean() const {
    if (violations() == 0) return ::testing::AssertionSuccess();
    std::lock_guard lock(report_mutex_);
    return ::testing::AssertionFailure() << violations() << " violation(s) in " << reuses()
                                         << " reuses; the first: " << first_violation_;
  }

 private:
  struct entry {
    bool allocated = true;
    std::uint64_t cookie = 0;
  };
  struct alignas(64) shard {
    std::mutex mutex;
    std::unordered_map<void*, entry> entries;
  };
  static constexpr std::size_t kShards = 64;

  shard& shard_of(void* object) noexcept {
    const auto bits = reinterpret_cast<std::uintptr_t>(object);
    return shards_[((bits >> 4) * 0x9e3779b97f4a7c15ULL) >> 58];
  }

  void report(void* object, const std::string& what) {
    // Relaxed: a tally, read after the threads are joined.
    if (violations_.fetch_add(1, std::memory_order_relaxed) == 0) {
      std::lock_guard lock(report_mutex_);
      first_violation_ =
          what + " (object " + std::to_string(reinterpret_cast<std::uintptr_t>(object)) + ")";
    }
  }

  const grace::domain& domain_;
  std::array<shard, kShards> shards_;
  std::atomic<std::uint64_t> reuses_{0};
  std::atomic<std::uint64_t> fresh_{0};
  std::atomic<std::uint64_t> violations_{0};
  mutable std::mutex report_mutex_;
  std::string first_violation_;
};

// Every field of a stats snapshot, for failure messages.
inline std::string describe(const grace::pool_stats& s) {
  return "allocated=" + std::to_string(s.allocated) + " deallocated=" +
         std::to_string(s.deallocated) + " fresh=" + std::to_string(s.fresh) +
         " reused_from_chunks=" + std::to_string(s.reused_from_chunks) +
         " reused_after_gp=" + std::to_string(s.reused_after_gp) + " destroyed=" +
         std::to_string(s.destroyed) + " returned_to_system=" +
         std::to_string(s.returned_to_system) + " ready=" + std::to_string(s.ready) +
         " waiting_for_gp=" + std::to_string(s.waiting_for_gp) + " held_bytes=" +
         std::to_string(s.held_bytes) + " peak_held_bytes=" + std::to_string(s.peak_held_bytes) +
         " chunks=" + std::to_string(s.chunks) +
         " retained_chunks=" + std::to_string(s.retained_chunks);
}

// ---------------------------------------------------------------------------------------------
// Domains, pools and timings the tests share.

inline constexpr std::chrono::seconds kNoDrainTimer{10};  // the largest drain interval
inline constexpr std::chrono::milliseconds kHold{50};  // a reader lingers to widen races
inline constexpr std::chrono::seconds kNoDeadlock{60};  // watchdog budget for calls that return

// A domain whose drain timer never fires: grace periods only when the test asks for them.
inline grace::domain_options quiet() {
  grace::domain_options o;
  o.drain_interval = kNoDrainTimer;
  return o;
}

// Small magazines: many seals, promotions and depot moves per object.
inline grace::pool_options small_magazines() {
  grace::pool_options o;
  o.low_watermark = 4;
  o.high_watermark = 16;
  o.batch = 8;
  o.magazine_capacity = 8;
  return o;
}

// Succeeds iff constructing a pool of `object_size` with `options` throws
// std::invalid_argument whose message names `option`.
inline ::testing::AssertionResult rejects(std::size_t object_size,
                                          const grace::pool_options& options,
                                          std::string_view option) {
  grace::domain d(quiet());
  return grace::testing::rejects_options(
      [&] { grace::object_pool pool(object_size, options, d); }, option, "the pool");
}

// ---------------------------------------------------------------------------------------------
// Object contents.

// Sets every byte of the object to `value`.
inline void fill_object(void* object, std::size_t bytes, unsigned char value) noexcept {
  std::memset(object, value, bytes);
}

// True iff every byte of the object still equals its first byte.
inline bool object_intact(const void* object, std::size_t bytes) noexcept {
  const auto* p = static_cast<const unsigned char*>(object);
  for (std::size_t i = 1; i < bytes; ++i) {
    if (p[i] != p[0]) return false;
  }
  return true;
}

// ---------------------------------------------------------------------------------------------
// A small, fast random source (xorshift64*); each thread owns one.
class random_source {
 public:
  explicit random_source(std::uint64_t seed) noexcept : state_(seed * 0x9e3779b97f4a7c15ULL | 1) {}
  std::uint64_t next() noexcept {
    state_ ^= state_ >> 12;
    state_ ^= state_ << 25;
    state_ ^= state_ >> 27;
    return state_ * 0x2545f4914f6cdd1dULL;
  }
  // Uniform-ish in [0, bound).
  std::size_t below(std::size_t bound) noexcept { return static_cast<std::size_t>(next() % bound); }

 private:
  std::uint64_t state_;
};

// ---------------------------------------------------------------------------------------------
// Concurrent churn checked by a reuse_oracle.

// Which churning threads make their calls inside read guards (bursts of 32 calls per guard).
enum class guards { never, always, odd_threads };

struct churn_options {
  unsigned threads = 2;
  std::size_t operations = 100'000;  // per thread
  enum guards guards = guards::never;
  bool bulk = true;                  // also allocate_bulk / deallocate_bulk
  bool hand_off = true;              // objects deallocated by a thread that did not allocate them
  std::size_t max_held = 1500;       // objects one thread holds at most
};

struct churn_totals {
  std::uint64_t allocated = 0;     // objects the test allocated
  std::uint64_t deallocated = 0;   // objects the test deallocated
  std::uint64_t corrupted = 0;     // held objects whose bytes changed while the test held them
};

// Runs `options.threads` threads that allocate objects, fill them with a byte of their own,
// check the byte is intact before deallocating, and deallocate them (singly, in bulk, or
// after handing them to another thread through shared slots). Every allocate and deallocate
// goes through `oracle`. Returns with every object deallocated.
inline churn_totals churn(grace::object_pool& pool, reuse_oracle& oracle,
                          const churn_options& options) {
  constexpr std::size_t kSlots = 64;
  std::array<std::atomic<void*>, kSlots> slots{};
  std::atomic<std::uint64_t> allocated{0};
  std::atomic<std::uint64_t> deallocated{0};
  std::atomic<std::uint64_t> corrupted{0};
  const std::size_t bytes = pool.object_size();
  const std::size_t batch = pool.options().batch;

  run_threads(options.threads, [&](unsigned index) {
    random_source random(index + 1);
    std::vector<void*> held;
    held.reserve(options.max_held + 4 * batch + 8);
    std::vector<void*> bulk(4 * batch + 8);
    std::uint64_t my_allocated = 0;
    std::uint64_t my_deallocated = 0;
    std::uint64_t my_corrupted = 0;
    unsigned char next_value = static_cast<unsigned char>(index * 37 + 1);
    bool growing = true;

    auto take = [&](void* object) {
      oracle.on_allocate(object);
      fill_object(object, bytes, next_value++);
      held.push_back(object);
      ++my_allocated;
    };
    auto check = [&](void* object) {
      if (!object_intact(object, bytes)) ++my_corrupted;
    };
    auto give_back = [&](std::size_t i) {
      void* object = held[i];
      held[i] = held.back();
      held.pop_back();
      check(object);
      oracle.on_deallocate(object);
      pool.deallocate(object);
      ++my_deallocated;
    };

    auto step = [&] {
      if (held.size() >= options.max_held) growing = false;
      if (held.empty()) growing = true;
      const std::size_t roll = random.below(64);
      if (options.bulk && roll == 0) {
        const std::size_t n = random.below(bulk.size());
        if (growing) {
          pool.allocate_bulk(bulk.data(), n);
          for (std::size_t i = 0; i < n; ++i) take(bulk[i]);
        } else {
          const std::size_t m = std::min(n, held.size());
          for (std::size_t i = 0; i < m; ++i) {
            const std::size_t at = random.below(held.size());
            bulk[i] = held[at];
            held[at] = held.back();
            held.pop_back();
            check(bulk[i]);
            oracle.on_deallocate(bulk[i]);
          }
          pool.deallocate_bulk(bulk.data(), m);
          my_deallocated += m;
        }
        return;
      }
      if (options.hand_off && roll == 1 && !held.empty()) {
        const std::size_t at = random.below(held.size());
        void* mine = held[at];
        held[at] = held.back();
        held.pop_back();
        // AcqRel: Release publishes our writes to `mine` to the thread that takes it;
        // Acquire takes the previous occupant with its writes; pairs with this same
        // exchange on the other threads (and the drain below).
        void* theirs = slots[random.below(kSlots)].exchange(mine, std::memory_order_acq_rel);
        if (theirs != nullptr) held.push_back(theirs);
        return;
      }
      // Mostly in the phase's direction, sometimes against it.
      const bool allocate_now = held.empty() || (growing ? roll < 48 : roll < 16);
      if (allocate_now) {
        take(pool.allocate());
      } else {
        give_back(random.below(held.size()));
      }
    };

    const bool inside_guards = options.guards == guards::always ||
                               (options.guards == guards::odd_threads && index % 2 == 1);
    for (std::size_t done = 0; done < options.operations;) {
      if (inside_guards) {
        auto guard = grace::pin();
        for (int i = 0; i < 32 && done < options.operations; ++i, ++done) step();
      } else {
        step();
        ++done;
      }
    }
    while (!held.empty()) give_back(held.size() - 1);
    // Relaxed (all three): tallies, read after run_threads() joined the threads.
    allocated.fetch_add(my_allocated, std::memory_order_relaxed);
    deallocated.fetch_add(my_deallocated, std::memory_order_relaxed);
    corrupted.fetch_add(my_corrupted, std::memory_order_relaxed);
  });

  // Objects still parked in the hand-off slots.
  std::uint64_t drained = 0;
  for (std::atomic<void*>& slot : slots) {
    // Acquire: the writes of the thread that parked the object; pairs with the AcqRel
    // exchange above (the join orders it as well).
    if (void* object = slot.exchange(nullptr, std::memory_order_acquire)) {
      oracle.on_deallocate(object);
      pool.deallocate(object);
      ++drained;
    }
  }
  churn_totals totals;
  // Relaxed (all three): every thread was joined.
  totals.allocated = allocated.load(std::memory_order_relaxed);
  totals.deallocated = deallocated.load(std::memory_order_relaxed) + drained;
  totals.corrupted = corrupted.load(std::memory_order_relaxed);
  return totals;
}

// Success iff a churn() run that returned `totals` left everything accounted for: `oracle`
// saw no early or double reuse, no object was corrupted, every object allocated was
// deallocated, the pool counted the same allocations and deallocations, and more than a
// quarter of the allocations were reuses. A failure names every check that failed.
inline ::testing::AssertionResult churn_accounted(const grace::object_pool& pool,
                                                  const reuse_oracle& oracle,
                                                  const churn_totals& totals) {
  std::string failures;
  auto check = [&failures](bool holds, const std::string& what) {
    if (!holds) failures += "\n  " + what;
  };
  const ::testing::AssertionResult clean = oracle.clean();
  check(static_cast<bool>(clean), clean.message());
  check(totals.corrupted == 0, std::to_string(totals.corrupted) + " objects corrupted");
  check(totals.allocated == totals.deallocated,
        "allocated " + std::to_string(totals.allocated) + " objects, deallocated " +
            std::to_string(totals.deallocated));
  const grace::pool_stats s = pool.stats();
  check(s.allocated == totals.allocated,
        "the pool counted " + std::to_string(s.allocated) + " allocations, the test " +
            std::to_string(totals.allocated));
  check(s.deallocated == totals.deallocated,
        "the pool counted " + std::to_string(s.deallocated) + " deallocations, the test " +
            std::to_string(totals.deallocated));
  check(oracle.reuses() > totals.allocated / 4,
        "only " + std::to_string(oracle.reuses()) + " of " + std::to_string(totals.allocated) +
            " allocations were reuses (a quarter or fewer)");
  if (failures.empty()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << failures << "\n  stats: " << describe(s);
}

// ---------------------------------------------------------------------------------------------
// A bounded single-producer single-consumer queue of pointers.
template <std::size_t Capacity>
class spsc_ring {
 public:
  bool push(void* object) noexcept {
    const std::size_t tail = tail_.load(std::memory_order_relaxed);  // Relaxed: ours.
    // Acquire: the consumer is done with the slot it gave back; pairs with the Release
    // store of head_ in pop().
    if (tail - head_.load(std::memory_order_acquire) == Capacity) return false;
    slots_[tail % Capacity] = object;
    // Release: the slot, and the object's contents, are visible to the consumer; pairs with
    // the Acquire load of tail_ in pop().
    tail_.store(tail + 1, std::memory_order_release);
    return true;
  }

  bool pop(void*& object) noexcept {
    const std::size_t head = head_.load(std::memory_order_relaxed);  // Relaxed: ours.
    // Acquire: the slot and the object's contents; pairs with the Release store in push().
    if (head == tail_.load(std::memory_order_acquire)) return false;
    object = slots_[head % Capacity];
    // Release: the slot may be reused by the producer; pairs with the Acquire load in push().
    head_.store(head + 1, std::memory_order_release);
    return true;
  }

 private:
  std::array<void*, Capacity> slots_{};
  alignas(64) std::atomic<std::size_t> head_{0};
  alignas(64) std::atomic<std::size_t> tail_{0};
};

// A producer thread's loop: allocates objects, fills each with the next byte value after
// `value`, and pushes it into `queue`, until `stop` is set. An object that the full queue
// has not taken by then goes back to the pool.
template <std::size_t Capacity>
void produce_until(const std::atomic<bool>& stop, grace::object_pool& pool,
                   spsc_ring<Capacity>& queue, unsigned char value) {
  const std::size_t bytes = pool.object_size();
  // Acquire: pairs with the Release store of `stop` by the thread that ends the run.
  while (!stop.load(std::memory_order_acquire)) {
    void* p = pool.allocate();
    fill_object(p, bytes, ++value);
    while (!queue.push(p)) {
      // Acquire: as above.
      if (stop.load(std::memory_order_acquire)) {
        pool.deallocate(p);
        return;
      }
      std::this_thread::yield();
    }
  }
}

struct consumed {
  std::uint64_t objects = 0;    // popped and deallocated
  std::uint64_t corrupted = 0;  // of those, objects whose bytes changed after they were filled
};

// A consumer thread's loop: pops objects from `queue`, checks that each is intact, and
// deallocates it, until `stop` is set.
template <std::size_t Capacity>
consumed consume_until(const std::atomic<bool>& stop, grace::object_pool& pool,
                       spsc_ring<Capacity>& queue) {
  const std::size_t bytes = pool.object_size();
  consumed totals;
  void* p = nullptr;
  // Acquire: pairs with the Release store of `stop` by the thread that ends the run.
  while (!stop.load(std::memory_order_acquire)) {
    if (!queue.pop(p)) {
      std::this_thread::yield();
      continue;
    }
    totals.corrupted += !object_intact(p, bytes);
    pool.deallocate(p);
    ++totals.objects;
  }
  return totals;
}

// After the producer and consumer were joined: deallocates what is left in `queue`.
template <std::size_t Capacity>
void deallocate_rest(grace::object_pool& pool, spsc_ring<Capacity>& queue) {
  void* p = nullptr;
  while (queue.pop(p)) pool.deallocate(p);
}

// ---------------------------------------------------------------------------------------------
// Keeps the calling thread on the CPU it runs on now, for the object's lifetime. The pool's
// caches are per CPU: a single-threaded test that must meet the same cache at every call
// (to count magazine refills exactly, or to steer an object into a ready magazine) pins.
class pin_to_current_cpu {
 public:
  pin_to_current_cpu() {
    CPU_ZERO(&previous_);
    pinned_ = ::pthread_getaffinity_np(::pthread_self(), sizeof(previous_), &previous_) == 0;
    const int cpu = ::sched_getcpu();
    if (!pinned_ || cpu < 0) {
      pinned_ = false;
      return;
    }
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(cpu, &one);
    pinned_ = ::pthread_setaffinity_np(::pthread_self(), sizeof(one), &one) == 0;
  }
  ~pin_to_current_cpu() {
    if (pinned_) ::pthread_setaffinity_np(::pthread_self(), sizeof(previous_), &previous_);
  }
  pin_to_current_cpu(const pin_to_current_cpu&) = delete;
  pin_to_current_cpu& operator=(const pin_to_current_cpu&) = delete;

  bool pinned() const noexcept { return pinned_; }

 private:
  cpu_set_t previous_;
  bool pinned_ = false;
};

}  // namespace grace::testing::alloc
