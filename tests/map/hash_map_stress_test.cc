// Stress tests for grace::hash_map (CTest label `stress`): exact content after concurrent
// updates of disjoint key ranges, readers that never miss a key present the whole time while
// the table grows and shrinks, for_each() visiting stable keys exactly once across resizes
// and replacements, values that are never seen torn or recycled, std::string keys and
// values, an exact size() under migrations and signals, clear() racing with writers, and
// teardown of millions of elements.
//
// Harness conventions:
//   - Values are checked_value (map_testing.h): 64 bytes carrying the key, ~key, a version
//     and a checksum of (key, version). A reader that sees a torn value, another key's value
//     (a recycled element) or a destroyed one (poisoned_value overwrites itself in its
//     destructor) fails valid_for(key).
//   - Threads start together (grace::testing::run_threads); writers do a fixed amount of work
//     sized by grace::testing::iterations() (smaller under sanitizers); readers run until
//     every writer is done.
//   - Every test asserts that the table really grew and shrank meanwhile, so a run that
//     missed the resize windows fails instead of passing vacuously.
//   - Worker threads report failures with ASSERT_* (which ends that thread's loop) and count
//     problems in atomics the main thread checks after the join.
#include <absl/hash/hash.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "grace/map/hash_map.h"
#include "grace/reclaim/domain.h"
#include "grace/reclaim/read_guard.h"
#include "tests/map/map_testing.h"
#include "tests/testing/testing.h"

namespace {

namespace gt = grace::testing;
namespace gm = grace::testing::map;
using gm::checked_value;
using gm::mod7_hash;
using namespace std::chrono_literals;

constexpr auto kNoDeadlock = 150s;  // watchdog budget for one test's threads

// ---------------------------------------------------------------------------------------------
// Values that detect torn, recycled and destroyed reads.

// checked_value, non-trivially destructible: elements go through retire(), and the
// destructor overwrites the value so that a reader still holding it fails valid_for().
struct poisoned_value : checked_value {
  poisoned_value() = default;
  poisoned_value(const checked_value& v) noexcept : checked_value(v) {}  // NOLINT: implicit
  poisoned_value(const poisoned_value&) = default;
  poisoned_value& operator=(const poisoned_value&) = default;
  ~poisoned_value() {
    // Volatile: the stores must survive dead-store elimination at the end of the lifetime.
    auto poison = [](std::uint64_t& word) {
      *static_cast<volatile std::uint64_t*>(&word) = 0xdeadbeefdeadbeefULL;
    };
    poison(key);
    poison(not_key);
    poison(version);
    for (std::uint64_t& word : check) poison(word);
  }
  poisoned_value next() const noexcept { return checked_value::next(); }
};
static_assert(sizeof(poisoned_value) == 64);

// The concurrency budget. testing::iterations() divides by 8 under sanitizers; the asan preset
// builds with -O2 and runs these loops several times faster than the -O0 debug preset, so an
// eighth leaves too few operations to hit the race windows. Sanitized runs keep half instead,
// which still keeps the suite far within its time budget on a 2-core machine.
std::size_t stress_budget(std::size_t plain) {
  return gt::kSanitized ? std::max<std::size_t>(plain / 2, 1) : plain;
}

grace::hash_map_options small_table(std::size_t max_buckets = std::size_t{1} << 16) {
  grace::hash_map_options options;
  options.initial_buckets = 1;
  options.min_buckets = 1;
  options.max_buckets = max_buckets;
  return options;
}

// Lets readers run until every writer has finished.
class writers_done {
 public:
  explicit writers_done(unsigned writers) : remaining_(writers) {}
  // Relaxed (both): a stop signal only; results are compared after join().
  void finish() noexcept { remaining_.fetch_sub(1, std::memory_order_relaxed); }
  bool all() const noexcept { return remaining_.load(std::memory_order_relaxed) == 0; }

  // A writer holds one for its whole loop, so that readers stop even when a failed ASSERT
  // ends the writer early.
  class finisher {
   public:
    explicit finisher(writers_done& done) noexcept : done_(done) {}
    ~finisher() { done_.finish(); }
    finisher(const finisher&) = delete;
    finisher& operator=(const finisher&) = delete;

   private:
    writers_done& done_;
  };

 private:
  std::atomic<unsigned> remaining_;
};

// Counts problems seen by worker threads; checked after the join.
struct problems {
  std::atomic<std::uint64_t> misses{0};
  std::atomic<std::uint64_t> bad_values{0};
  std::atomic<std::uint64_t> regressions{0};  // a version older than one seen before
  // Relaxed (all): tallies read after join().
  void miss() noexcept { misses.fetch_add(1, std::memory_order_relaxed); }
  void bad() noexcept { bad_values.fetch_add(1, std::memory_order_relaxed); }
  void regressed() noexcept { regressions.fetch_add(1, std::memory_order_relaxed); }
  std::uint64_t total() const noexcept {
    return misses.load(std::memory_order_relaxed) + bad_values.load(std::memory_order_relaxed) +
           regressions.load(std::memory_order_relaxed);
  }
};

// Inserts, then erases, `count` keys from `first`: one grow-and-shrink wave.
template <class Map, class Make>
void wave(Map& map, std::uint64_t first, std::uint64_t count, Make make) {
  for (std::uint64_t k = first; k < first + count; ++k) ASSERT_TRUE(map.insert(k, make(k)));
  for (std::uint64_t k = first; k < first + count; ++k) ASSERT_TRUE(map.erase(k));
}

// =============================================================================================
// Disjoint key ranges: exact content.

// Each thread owns a key range and knows exactly what its keys hold, so every return value is
// checked exactly even though all threads share the map (and its resizes).
TEST(HashMapStress, ThreadsUpdatingDisjointKeyRangesEndWithExactlyTheExpectedContent) {
  constexpr unsigned kThreads = 4;
  constexpr std::uint64_t kRange = 1500;
  const std::size_t ops = stress_budget(1'500'000);
  grace::hash_map<std::uint64_t, checked_value> map(small_table());
  std::vector<std::vector<std::optional<std::uint64_t>>> expected(
      kThreads, std::vector<std::optional<std::uint64_t>>(kRange));
  gt::watchdog dog(kNoDeadlock, "disjoint key ranges");
  gt::run_threads(kThreads, [&](unsigned t) {
    std::mt19937_64 rng(0x5eed + t);
    auto& mine = expected[t];
    const std::uint64_t base = t * kRange;
    std::uint64_t version = 0;
    bool filling = true;
    for (std::size_t op = 0; op < ops; ++op) {
      if (op % 8000 == 0) filling = !filling;  // population waves: grow and shrink
      const std::uint64_t i = rng() % kRange;
      const std::uint64_t key = base + i;
      std::optional<std::uint64_t>& slot = mine[i];
      const bool present = slot.has_value();
      // 20% reads; then inserting operations (45% filling, 4% draining), 20% replacing
      // operations, and erasing operations for the rest; 1% reserve.
      const unsigned r = static_cast<unsigned>(rng() % 100);
      const unsigned inserting = filling ? 45 : 4;
      const unsigned sub = static_cast<unsigned>(rng() % 3);
      if (r < 20) {
        if (sub == 0) {
          const auto found = map.find(key);
          ASSERT_EQ(found.has_value(), present) << "thread " << t << " op " << op;
          if (present) {
            ASSERT_TRUE(found->valid_for(key) && found->version == *slot);
          }
        } else if (sub == 1) {
          bool ok = false;
          ASSERT_EQ(map.visit(key,
                              [&](const checked_value& v) {
                                ok = v.valid_for(key) && v.version == *slot;
                              }),
                    present);
          if (present) {
            ASSERT_TRUE(ok);
          }
        } else {
          auto view = map.pin();
          const checked_value* p = view.find(key);
          ASSERT_EQ(p != nullptr, present);
          if (present) {
            ASSERT_TRUE(p->valid_for(key) && p->version == *slot);
          }
        }
      } else if (r < 20 + inserting) {
        if (sub == 0) {
          ASSERT_EQ(map.insert(key, checked_value::make(key, ++version)), !present);
          if (!present) slot = version;
        } else if (sub == 1) {
          ASSERT_EQ(map.insert_or_assign(key, checked_value::make(key, ++version)), !present);
          slot = version;
        } else {
          ASSERT_EQ(map.try_emplace(key, checked_value::make(key, ++version)), !present);
          if (!present) slot = version;
        }
      } else if (r < 40 + inserting) {
        if (sub == 0) {
          ASSERT_EQ(map.assign(key, checked_value::make(key, ++version)), present);
          if (present) slot = version;
        } else {
          const bool updated = map.update(key, [&](const checked_value& old) {
            EXPECT_TRUE(old.valid_for(key));
            return old.next();
          });
          ASSERT_EQ(updated, present);
          if (present) slot = *slot + 1;
        }
      } else if (r < 99) {
        if (sub != 0) {
          ASSERT_EQ(map.erase(key), present) << "thread " << t << " op " << op;
          slot.reset();
        } else {
          const bool want = (rng() & 1) != 0;
          ASSERT_EQ(map.erase_if(key,
                                 [&](const checked_value& v) {
                                   EXPECT_TRUE(v.valid_for(key) && present && v.version == *slot);
                                   return want;
                                 }),
                    present && want);
          if (want) slot.reset();
        }
      } else if (rng() % 16 == 0) {
        // A reservation holds until clear(): keep it small enough that the waves still
        // shrink the table below their peak.
        map.reserve(rng() % (kThreads * kRange / 16));
      }
    }
  });
  ASSERT_FALSE(HasFailure());

  std::size_t expected_size = 0;
  for (unsigned t = 0; t < kThreads; ++t) {
    for (std::uint64_t i = 0; i < kRange; ++i) {
      const std::uint64_t key = t * kRange + i;
      const auto found = map.find(key);
      ASSERT_EQ(found.has_value(), expected[t][i].has_value()) << "key " << key;
      if (found) {
        ++expected_size;
        ASSERT_TRUE(found->valid_for(key)) << "key " << key;
        ASSERT_EQ(found->version, *expected[t][i]) << "key " << key;
      }
    }
  }
  EXPECT_EQ(map.size(), expected_size);
  std::vector<int> visits(kThreads * kRange, 0);
  std::size_t visited = 0;
  map.for_each([&](const std::uint64_t& key, const checked_value& v) {
    ++visited;
    ASSERT_LT(key, kThreads * kRange);
    ++visits[key];
    const auto& slot = expected[key / kRange][key % kRange];
    EXPECT_TRUE(slot.has_value() && v.valid_for(key) && v.version == *slot) << "key " << key;
  });
  EXPECT_EQ(visited, expected_size);
  for (std::uint64_t key = 0; key < kThreads * kRange; ++key) {
    ASSERT_EQ(visits[key], expected[key / kRange][key % kRange].has_value() ? 1 : 0) << key;
  }
  // How far the random waves drain depends on the budget (sanitizers run fewer operations),
  // so the threads end by erasing every key they own, at once: the table must shrink back.
  gt::run_threads(kThreads, [&](unsigned t) {
    for (std::uint64_t i = 0; i < kRange; ++i) {
      ASSERT_EQ(map.erase(t * kRange + i), expected[t][i].has_value()) << "final drain";
    }
  });
  EXPECT_EQ(map.size(), 0u);
  const grace::hash_map_stats s = map.stats();
  EXPECT_GT(s.grows, 0u);
  EXPECT_GT(s.shrinks, 0u);
}

// =============================================================================================
// Resizes under readers and writers.

// Stable keys are present the whole time (only updated); churn keys come and go in waves that
// make the table grow and shrink. No reader may ever miss a stable key, see a torn value or
// see a key's version go backwards; no update may be lost.
TEST(HashMapStress, ReadersNeverMissAKeyPresentTheWholeTimeWhileTheTableGrowsAndShrinks) {
  constexpr std::uint64_t kStable = 256;
  constexpr std::uint64_t kChurnBase = std::uint64_t{1} << 40;
  constexpr unsigned kWriters = 2;
  constexpr unsigned kReaders = 2;
  const std::size_t waves = stress_budget(80);
  const std::uint64_t wave_size = 4096;
  grace::hash_map<std::uint64_t, checked_value> map(small_table());
  for (std::uint64_t k = 0; k < kStable; ++k) {
    ASSERT_TRUE(map.insert(k, checked_value::make(k, 0)));
  }
  std::vector<std::vector<std::uint64_t>> increments(kWriters, std::vector<std::uint64_t>(kStable));
  problems seen;
  std::atomic<std::uint64_t> reads{0};
  writers_done done(kWriters);
  gt::watchdog dog(kNoDeadlock, "readers against resize waves");
  gt::run_threads(kWriters + kReaders, [&](unsigned t) {
    std::mt19937_64 rng(0xabc + t);
    if (t < kWriters) {
      writers_done::finisher finish(done);
      const std::uint64_t base = kChurnBase + t * (wave_size * waves);
      for (std::size_t w = 0; w < waves; ++w) {
        const std::uint64_t first = base + w * wave_size;
        for (std::uint64_t k = first; k < first + wave_size; ++k) {
          ASSERT_TRUE(map.insert(k, checked_value::make(k, 0)));
          if (k % 4 == 0) {
            const std::uint64_t s = rng() % kStable;
            ASSERT_TRUE(map.update(s, [](const checked_value& v) { return v.next(); }));
            ++increments[t][s];
          }
        }
        for (std::uint64_t k = first; k < first + wave_size; ++k) {
          ASSERT_TRUE(map.erase(k));
          if (k % 4 == 0) {
            const std::uint64_t s = rng() % kStable;
            ASSERT_TRUE(map.update(s, [](const checked_value& v) { return v.next(); }));
            ++increments[t][s];
          }
        }
      }
      return;
    }
    std::vector<std::uint64_t> last(kStable, 0);
    std::uint64_t local_reads = 0;
    auto observe = [&](std::uint64_t k, const checked_value* v) {
      if (v == nullptr) return seen.miss();
      if (!v->valid_for(k)) return seen.bad();
      if (v->version < last[k]) return seen.regressed();
      last[k] = v->version;
    };
    while (!done.all()) {
      for (std::uint64_t k = 0; k < kStable; ++k) {
        switch ((k + local_reads) % 4) {
          case 0: {
            const auto v = map.find(k);
            observe(k, v ? &*v : nullptr);
            break;
          }
          case 1:
            if (!map.contains(k)) seen.miss();
            break;
          case 2:
            if (!map.visit(k, [&](const checked_value& v) { observe(k, &v); })) seen.miss();
            break;
          case 3: {
            auto view = map.pin();
            observe(k, view.find(k));
            break;
          }
        }
      }
      ++local_reads;
    }
    // Relaxed: a tally read after join.
    reads.fetch_add(local_reads, std::memory_order_relaxed);
  });
  ASSERT_FALSE(HasFailure());
  EXPECT_EQ(seen.misses.load(std::memory_order_relaxed), 0u);  // Relaxed: joined.
  EXPECT_EQ(seen.bad_values.load(std::memory_order_relaxed), 0u);
  EXPECT_EQ(seen.regressions.load(std::memory_order_relaxed), 0u);
  EXPECT_GT(reads.load(std::memory_order_relaxed), 0u);
  for (std::uint64_t k = 0; k < kStable; ++k) {
    std::uint64_t total = 0;
    for (unsigned t = 0; t < kWriters; ++t) total += increments[t][k];
    const auto v = map.find(k);
    ASSERT_TRUE(v.has_value() && v->valid_for(k)) << k;
    EXPECT_EQ(v->version, total) << "key " << k << ": updates lost or applied twice";
  }
  EXPECT_EQ(map.size(), kStable);
  const grace::hash_map_stats s = map.stats();
  EXPECT_GE(s.grows, 2u);
  EXPECT_GE(s.shrinks, 2u);
}

// for_each() visits every key present for the whole iteration exactly once, even while other
// threads replace those keys (insert_or_assign), insert and erase other keys, and the table
// grows and shrinks. Typed by the hash: well mixed, and seven hashes for all keys.
template <class Hash>
class HashMapForEachStress : public ::testing::Test {};
struct hash_names {
  template <class H>
  static std::string GetName(int) {
    return std::is_same_v<H, mod7_hash> ? "KeysModSevenHash" : "AbslHash";
  }
};
using for_each_hashes = ::testing::Types<absl::Hash<std::uint64_t>, mod7_hash>;
TYPED_TEST_SUITE(HashMapForEachStress, for_each_hashes, hash_names);

TYPED_TEST(HashMapForEachStress, VisitsEveryKeyPresentTheWholeTimeExactlyOnceDuringResizes) {
  const bool chains = std::is_same_v<TypeParam, mod7_hash>;
  // The waves take the population from `stable` to several times it and back, across the
  // shrink threshold (1/8 of the buckets).
  const std::uint64_t stable = chains ? 64 : 512;
  const std::uint64_t wave_size = chains ? 1024 : 4096;
  const std::size_t waves = stress_budget(chains ? 80 : 96);
  constexpr std::uint64_t kChurnBase = std::uint64_t{1} << 40;
  grace::hash_map<std::uint64_t, checked_value, TypeParam> map(small_table());
  for (std::uint64_t k = 0; k < stable; ++k) ASSERT_TRUE(map.insert(k, checked_value::make(k, 0)));
  problems seen;
  std::atomic<std::uint64_t> iterations{0};
  std::atomic<std::uint64_t> replacements{0};
  writers_done churned(1);
  writers_done done(2);
  gt::watchdog dog(kNoDeadlock, "for_each against resize waves");
  // Threads: 0 churns (waves), 1 replaces stable keys, 2 and 3 iterate.
  gt::run_threads(4, [&](unsigned t) {
    if (t == 0) {
      writers_done::finisher finish_churn(churned);
      writers_done::finisher finish(done);
      for (std::size_t w = 0; w < waves; ++w) {
        wave(map, kChurnBase + w * wave_size, wave_size,
             [](std::uint64_t k) { return checked_value::make(k, 0); });
        if (::testing::Test::HasFatalFailure()) break;
      }
      return;
    }
    if (t == 1) {
      writers_done::finisher finish(done);
      std::uint64_t replaced = 0;
      std::mt19937_64 rng(7);
      // Replace until the churn is done, and at least as many times as there are keys.
      while (!churned.all() || replaced < stable) {
        const std::uint64_t k = rng() % stable;
        ASSERT_FALSE(map.insert_or_assign(k, checked_value::make(k, ++replaced)));
      }
      // Relaxed: a tally read after join.
      replacements.store(replaced, std::memory_order_relaxed);
      return;
    }
    std::vector<int> visits(stable);
    while (!done.all()) {
      std::fill(visits.begin(), visits.end(), 0);
      map.for_each([&](const std::uint64_t& key, const checked_value& v) {
        if (key < stable) ++visits[key];
        if (!v.valid_for(key)) seen.bad();
      });
      for (std::uint64_t k = 0; k < stable; ++k) {
        if (visits[k] != 1) {
          ADD_FAILURE() << "key " << k << " visited " << visits[k] << " times in one for_each";
          seen.miss();
        }
      }
      if (seen.total() != 0) break;
      iterations.fetch_add(1, std::memory_order_relaxed);  // Relaxed: a tally.
    }
  });
  EXPECT_EQ(seen.total(), 0u);
  EXPECT_GT(iterations.load(std::memory_order_relaxed), 0u);  // Relaxed: joined.
  EXPECT_GT(replacements.load(std::memory_order_relaxed), 0u);
  const grace::hash_map_stats s = map.stats();
  EXPECT_GE(s.grows, 2u);
  EXPECT_GE(s.shrinks, 2u);
}

// =============================================================================================
// Torn and recycled values.

// Writers overwrite, erase and insert at full speed while readers check every value they see
// through find, visit and pinned views (a view's pointers are re-checked, byte for byte, after
// the writers had time to replace them). Typed by the value: trivially destructible (the pool
// recycles elements) and poisoned on destruction (elements are retired).
template <class Value>
class HashMapValueStress : public ::testing::Test {};
struct value_names {
  template <class V>
  static std::string GetName(int) {
    return std::is_same_v<V, poisoned_value> ? "PoisonedOnDestruction" : "TriviallyDestructible";
  }
};
using value_types = ::testing::Types<checked_value, poisoned_value>;
TYPED_TEST_SUITE(HashMapValueStress, value_types, value_names);

TYPED_TEST(HashMapValueStress, ReadersNeverSeeATornRecycledOrDestroyedValue) {
  using value = TypeParam;
  constexpr std::uint64_t kKeys = 512;
  constexpr unsigned kWriters = 2;
  constexpr unsigned kReaders = 2;
  const std::size_t ops = stress_budget(1'500'000);
  grace::hash_map<std::uint64_t, value> map(small_table());
  problems seen;
  std::atomic<std::uint64_t> checked{0};
  writers_done done(kWriters);
  gt::watchdog dog(kNoDeadlock, "torn-value readers against writers");
  gt::run_threads(kWriters + kReaders, [&](unsigned t) {
    std::mt19937_64 rng(0x70a + t);
    if (t < kWriters) {
      writers_done::finisher finish(done);
      std::uint64_t version = 0;
      bool filling = true;
      for (std::size_t op = 0; op < ops; ++op) {
        if (op % 2000 == 0) filling = !filling;
        const std::uint64_t k = rng() % kKeys;
        const unsigned r = static_cast<unsigned>(rng() % 8);
        switch (r) {
          case 0:
          case 1:
            map.insert_or_assign(k, checked_value::make(k, ++version));
            break;
          case 2:
            map.insert(k, checked_value::make(k, ++version));
            break;
          case 3:
            map.assign(k, checked_value::make(k, ++version));
            break;
          case 4:
            map.update(k, [&](const value& old) {
              if (!old.valid_for(k)) seen.bad();
              return old.next();
            });
            break;
          default:
            if (!filling || r == 5) map.erase(k);
            break;
        }
      }
      return;
    }
    std::uint64_t local = 0;
    while (!done.all()) {
      const std::uint64_t k = rng() % kKeys;
      switch (rng() % 3) {
        case 0:
          if (const auto v = map.find(k); v && !v->valid_for(k)) seen.bad();
          ++local;
          break;
        case 1:
          map.visit(k, [&](const value& v) {
            if (!v.valid_for(k)) seen.bad();
          });
          ++local;
          break;
        case 2: {
          // Hold a few pointers while the writers run, then check they did not change.
          auto view = map.pin();
          const value* held[8];
          checked_value copies[8];
          std::uint64_t keys[8];
          for (int i = 0; i < 8; ++i) {
            keys[i] = (k + static_cast<std::uint64_t>(i) * 61) % kKeys;
            held[i] = view.find(keys[i]);
            if (held[i] != nullptr) {
              if (!held[i]->valid_for(keys[i])) seen.bad();
              copies[i] = *held[i];
            }
          }
          std::this_thread::yield();  // widen the window: writers replace these keys
          for (int i = 0; i < 8; ++i) {
            if (held[i] == nullptr) continue;
            const checked_value& now = *held[i];
            if (!now.valid_for(keys[i]) ||
                std::memcmp(&now, &copies[i], sizeof(checked_value)) != 0) {
              seen.bad();
            }
          }
          local += 8;
          break;
        }
      }
    }
    // Relaxed: a tally read after join.
    checked.fetch_add(local, std::memory_order_relaxed);
  });
  ASSERT_FALSE(this->HasFailure());
  EXPECT_EQ(seen.bad_values.load(std::memory_order_relaxed), 0u);  // Relaxed: joined.
  EXPECT_GT(checked.load(std::memory_order_relaxed), 0u);
  // Quiescent now: size() is exact and every value is intact.
  std::size_t visited = 0;
  map.for_each([&](const std::uint64_t& key, const value& v) {
    ++visited;
    EXPECT_TRUE(v.valid_for(key)) << key;
  });
  EXPECT_EQ(map.size(), visited);
  EXPECT_GT(map.stats().pool.reused_after_gp + map.stats().reclamation.reclaimed, 0u);
}

// =============================================================================================
// std::string keys and values.

std::string string_key(std::uint64_t k) {
  return "a string key long enough to be heap allocated #" + std::to_string(k);
}
std::string string_value(const std::string& key, std::uint64_t version) {
  return "value of [" + key + "] version " + std::to_string(version) + " padding padding";
}
// The value belongs to `key` and is well formed; returns its version (or nullopt).
std::optional<std::uint64_t> string_version(const std::string& key, const std::string& value) {
  const std::string prefix = "value of [" + key + "] version ";
  const std::string suffix = " padding padding";
  if (value.size() <= prefix.size() + suffix.size() ||
      value.compare(0, prefix.size(), prefix) != 0 ||
      value.compare(value.size() - suffix.size(), suffix.size(), suffix) != 0) {
    return std::nullopt;
  }
  return std::stoull(value.substr(prefix.size(), value.size() - prefix.size() - suffix.size()));
}

TEST(HashMapStress, StringKeysAndValuesStayExactUnderConcurrentUpdates) {
  constexpr unsigned kWriters = 2;
  constexpr unsigned kReaders = 2;
  constexpr std::uint64_t kRange = 800;
  const std::size_t ops = stress_budget(300'000);
  grace::hash_map<std::string, std::string> map(small_table());
  std::vector<std::vector<std::optional<std::uint64_t>>> expected(
      kWriters, std::vector<std::optional<std::uint64_t>>(kRange));
  problems seen;
  writers_done done(kWriters);
  gt::watchdog dog(kNoDeadlock, "string keys and values");
  gt::run_threads(kWriters + kReaders, [&](unsigned t) {
    std::mt19937_64 rng(0x57 + t);
    if (t < kWriters) {
      writers_done::finisher finish(done);
      auto& mine = expected[t];
      std::uint64_t version = 0;
      for (std::size_t op = 0; op < ops; ++op) {
        const std::uint64_t i = rng() % kRange;
        const std::string key = string_key(t * kRange + i);
        auto& slot = mine[i];
        const bool present = slot.has_value();
        switch (rng() % 6) {
          case 0:
            ASSERT_EQ(map.insert(key, string_value(key, ++version)), !present);
            if (!present) slot = version;
            break;
          case 1:
          case 2:
            ASSERT_EQ(map.insert_or_assign(key, string_value(key, ++version)), !present);
            slot = version;
            break;
          case 3: {
            const bool updated = map.update(key, [&](const std::string& old) {
              const auto v = string_version(key, old);
              if (!v || *v != *slot) seen.bad();
              return string_value(key, v.value_or(0) + 1000);
            });
            ASSERT_EQ(updated, present);
            if (present) slot = *slot + 1000;
            break;
          }
          default:
            ASSERT_EQ(map.erase(key), present);
            slot.reset();
            break;
        }
      }
      return;
    }
    while (!done.all()) {
      const std::string key = string_key(rng() % (kWriters * kRange));
      if (rng() % 2 == 0) {
        if (const auto v = map.find(key); v && !string_version(key, *v)) seen.bad();
      } else {
        map.visit(key, [&](const std::string& v) {
          if (!string_version(key, v)) seen.bad();
        });
      }
    }
  });
  ASSERT_FALSE(HasFailure());
  EXPECT_EQ(seen.bad_values.load(std::memory_order_relaxed), 0u);  // Relaxed: joined.
  std::size_t expected_size = 0;
  for (unsigned t = 0; t < kWriters; ++t) {
    for (std::uint64_t i = 0; i < kRange; ++i) {
      const std::string key = string_key(t * kRange + i);
      const auto v = map.find(key);
      ASSERT_EQ(v.has_value(), expected[t][i].has_value()) << key;
      if (v) {
        ++expected_size;
        EXPECT_EQ(string_version(key, *v), expected[t][i]) << key;
      }
    }
  }
  EXPECT_EQ(map.size(), expected_size);
  std::size_t visited = 0;
  map.for_each([&](const std::string&, const std::string&) { ++visited; });
  EXPECT_EQ(visited, expected_size);
}

// =============================================================================================
// The element count.

// Each CPU counts its inserts and erases by a restartable sequence, and a thread whose
// sequence the kernel restarts (preempted, migrated, signalled) counts by an atomic add
// instead (split_list::count()). More updaters than CPUs, moved between CPUs and signalled
// all the time by another thread, must leave size() equal to the content exactly.
TEST(HashMapStress, SizeStaysExactWhileUpdatersAreMovedBetweenCpusAndSignalled) {
  constexpr unsigned kThreads = 4;
  constexpr std::uint64_t kRange = 512;
  const std::size_t ops = stress_budget(1'200'000);
  grace::hash_map<std::uint64_t, checked_value> map(small_table());
  gt::cpu_disturber disturber;
  std::vector<std::vector<bool>> present(kThreads, std::vector<bool>(kRange, false));
  writers_done done(kThreads);
  std::atomic<bool> disturbed{false};
  gt::watchdog dog(kNoDeadlock, "size() under migrations and signals");
  std::vector<std::thread> updaters;
  for (unsigned t = 0; t < kThreads; ++t) {
    updaters.emplace_back([&, t] {
      {
        writers_done::finisher finish(done);
        std::mt19937_64 rng(0x5e + t);
        for (std::size_t op = 0; op < ops; ++op) {
          const std::uint64_t i = rng() % kRange;
          const std::uint64_t key = t * kRange + i;
          if (present[t][i]) {
            ASSERT_TRUE(map.erase(key)) << key;
          } else {
            ASSERT_TRUE(map.insert(key, checked_value::make(key, op))) << key;
          }
          present[t][i] = !present[t][i];
        }
      }
      // Alive until the disturbing ends: a finished thread's handle may name no thread in
      // the kernel, and glibc would then move or signal the caller instead.
      // Relaxed: a stop signal only.
      while (!disturbed.load(std::memory_order_relaxed)) std::this_thread::sleep_for(100us);
    });
  }
  while (!done.all()) {
    disturber.disturb(updaters);
    std::this_thread::yield();
  }
  disturbed.store(true, std::memory_order_relaxed);  // Relaxed: a stop signal only.
  for (std::thread& updater : updaters) updater.join();
  std::size_t expected_size = 0;
  for (const auto& mine : present) expected_size += std::count(mine.begin(), mine.end(), true);
  EXPECT_GT(disturber.disturbances(), 0u);
  EXPECT_EQ(map.size(), expected_size);
  std::size_t visited = 0;
  map.for_each([&](const std::uint64_t&, const checked_value&) { ++visited; });
  EXPECT_EQ(visited, expected_size);
}

// =============================================================================================
// clear() against writers.

TEST(HashMapStress, ClearRacingWithWritersLeavesSizeEqualToTheContent) {
  constexpr std::uint64_t kKeys = 2048;
  const std::size_t ops = stress_budget(150'000);
  grace::hash_map<std::uint64_t, poisoned_value> map(small_table());
  std::atomic<std::uint64_t> clears{0};
  writers_done done(2);
  gt::watchdog dog(kNoDeadlock, "clear() against writers");
  gt::run_threads(3, [&](unsigned t) {
    std::mt19937_64 rng(0xc1 + t);
    if (t < 2) {
      writers_done::finisher finish(done);
      for (std::size_t op = 0; op < ops; ++op) {
        const std::uint64_t k = rng() % kKeys;
        switch (rng() % 4) {
          case 0:
            map.insert(k, checked_value::make(k, op));
            break;
          case 1:
            map.insert_or_assign(k, checked_value::make(k, op));
            break;
          case 2:
            map.update(k, [](const poisoned_value& v) { return v.next(); });
            break;
          default:
            map.erase(k);
            break;
        }
      }
      return;
    }
    do {
      map.clear();
      clears.fetch_add(1, std::memory_order_relaxed);  // Relaxed: a tally read after join.
      std::this_thread::sleep_for(1ms);                // let the writers refill the map
    } while (!done.all());
  });
  std::size_t visited = 0;
  map.for_each([&](const std::uint64_t& key, const poisoned_value& v) {
    ++visited;
    EXPECT_TRUE(v.valid_for(key)) << key;
  });
  EXPECT_EQ(map.size(), visited);
  EXPECT_GE(clears.load(std::memory_order_relaxed), 1u);  // Relaxed: joined.
  map.clear();
  EXPECT_TRUE(map.empty());
  EXPECT_EQ(map.size(), 0u);
}

// clear() waits for reclamation (domain::barrier()), but only for what was erased before
// it: it must return while other threads keep updating. Writers run until the clearing
// thread has finished kClears clears; a clear() that waits for the writers to stop never
// lets that happen, and the watchdog ends the test.
TEST(HashMapStress, ClearReturnsWhileOtherThreadsKeepUpdating) {
  constexpr std::uint64_t kKeys = 2048;
  constexpr std::uint64_t kClears = 10;
  grace::hash_map<std::uint64_t, poisoned_value> map(small_table());
  std::atomic<std::uint64_t> clears{0};
  gt::watchdog dog(10s, "clear() while other threads keep updating (starved?)");
  gt::run_threads(3, [&](unsigned t) {
    std::mt19937_64 rng(0xc2 + t);
    if (t < 2) {
      // Relaxed: a progress count; it only decides when to stop.
      for (std::uint64_t op = 0; clears.load(std::memory_order_relaxed) < kClears; ++op) {
        const std::uint64_t k = rng() % kKeys;
        if (rng() % 2 == 0) {
          map.insert_or_assign(k, checked_value::make(k, op));
        } else {
          map.erase(k);
        }
      }
      return;
    }
    for (std::uint64_t i = 0; i < kClears; ++i) {
      std::this_thread::sleep_for(5ms);  // let the writers refill the map
      map.clear();
      clears.fetch_add(1, std::memory_order_relaxed);  // Relaxed: see the writers' loop.
    }
  });
  EXPECT_EQ(clears.load(std::memory_order_relaxed), kClears);  // Relaxed: joined.
}

// =============================================================================================
// Teardown.

// Destroying a map of millions of elements releases every chunk the pool took (counted by the
// allocator) and, under ASan, leaves nothing for LeakSanitizer.
TEST(HashMapStress, DestroyingAMapOfMillionsOfElementsReturnsAllItsMemory) {
  const std::uint64_t count = gt::iterations(2'000'000);
  gt::failing_allocator allocator;  // never fails here: it counts what is live
  {
    gt::watchdog dog(kNoDeadlock, "filling and destroying a map of millions of elements");
    grace::hash_map_options options;
    options.pool.allocator = allocator.get();
    grace::hash_map<std::uint64_t, std::uint64_t> map(options);
    for (std::uint64_t k = 0; k < count; ++k) ASSERT_TRUE(map.insert(k, ~k));
    ASSERT_EQ(map.size(), count);
    // Erase and replace some, so that elements are also waiting for grace periods.
    for (std::uint64_t k = 0; k < count; k += 16) ASSERT_TRUE(map.erase(k));
    for (std::uint64_t k = 1; k < count; k += 16) ASSERT_FALSE(map.insert_or_assign(k, k));
    EXPECT_GT(allocator.live_bytes(), static_cast<std::int64_t>(count * 16));
  }
  EXPECT_EQ(allocator.live_allocations(), 0);
  EXPECT_EQ(allocator.live_bytes(), 0);
}

// A value with a non-trivial destructor that counts itself.
std::atomic<std::int64_t> g_live_values{0};
struct counted_value {
  explicit counted_value(std::uint64_t v) : payload(v) {
    g_live_values.fetch_add(1, std::memory_order_relaxed);  // Relaxed: read after teardown.
  }
  counted_value(const counted_value& other) : payload(other.payload) {
    g_live_values.fetch_add(1, std::memory_order_relaxed);  // Relaxed: as above.
  }
  ~counted_value() { g_live_values.fetch_sub(1, std::memory_order_relaxed); }  // Relaxed: as above.
  counted_value& operator=(const counted_value&) = default;
  std::uint64_t payload;
  std::string heap = std::string(40, 'h');  // LeakSanitizer sees a leaked value
};

TEST(HashMapStress, DestroyingAMapOfNonTriviallyDestructibleValuesDestroysEveryValue) {
  const std::uint64_t count = gt::iterations(500'000);
  gt::failing_allocator allocator;
  {
    grace::hash_map_options options;
    options.pool.allocator = allocator.get();
    grace::hash_map<std::uint64_t, counted_value> map(options);
    for (std::uint64_t k = 0; k < count; ++k) ASSERT_TRUE(map.insert(k, counted_value(k)));
    for (std::uint64_t k = 0; k < count; k += 8) ASSERT_TRUE(map.erase(k));
    for (std::uint64_t k = 1; k < count; k += 8) {
      ASSERT_TRUE(
          map.update(k, [](const counted_value& v) { return counted_value(v.payload + 1); }));
    }
    // Keys 0, 8, 16, ... were erased: (count + 7) / 8 of them. The values still live are
    // at least those of the keys left (more while erased and replaced ones wait for their
    // grace period).
    EXPECT_GE(g_live_values.load(std::memory_order_relaxed),  // Relaxed: single thread here.
              static_cast<std::int64_t>(count - (count + 7) / 8));
  }
  EXPECT_EQ(g_live_values.load(std::memory_order_relaxed), 0);  // Relaxed: the map is gone.
  EXPECT_EQ(allocator.live_allocations(), 0);
}

TEST(HashMapStress, DestroyingAMapFilledByManyThreadsReturnsAllItsMemory) {
  constexpr unsigned kThreads = 4;
  const std::uint64_t per_thread = gt::iterations(150'000);
  gt::failing_allocator allocator;
  {
    grace::hash_map_options options;
    options.pool.allocator = allocator.get();
    grace::hash_map<std::string, std::string> map(options);
    gt::run_threads(kThreads, [&](unsigned t) {
      for (std::uint64_t i = 0; i < per_thread; ++i) {
        const std::string key = string_key(t * per_thread + i);
        ASSERT_TRUE(map.insert(key, string_value(key, i)));
        if (i % 4 == 0) {
          ASSERT_TRUE(map.erase(key));
        }
      }
    });
    EXPECT_EQ(map.size(), kThreads * (per_thread - (per_thread + 3) / 4));
  }
  EXPECT_EQ(allocator.live_allocations(), 0);
}

}  // namespace
